"""The command line: click commands and rich output only (`ringctx = ringctx.cli:main`).

    main.py         the `ringctx` group and prefill, generate, ingest, ask, info
    planning.py     plan and calibrate
    serve.py        serve (the HTTP server of ringctx/serve)
    environment.py  the report behind `ringctx info`
"""

from .main import main

__all__ = ["main"]
