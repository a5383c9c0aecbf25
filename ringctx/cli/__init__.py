"""The command line: click commands and rich output only (`ringctx = ringctx.cli:main`).

    main.py         the `ringctx` group and prefill, ingest, ask, info
    planning.py     plan and calibrate
    serve.py        serve (the HTTP server of ringctx/serve)
    environment.py  the report behind `ringctx info`
    progress.py     the prefill's progress bar and ETA, counted in work
"""

from .main import main

__all__ = ["main"]
