"""python -m ringctx (also what torchrun launches: torchrun ... -m ringctx prefill ...)."""

from .cli import main

if __name__ == "__main__":
    main()
