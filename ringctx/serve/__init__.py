"""`ringctx serve`: an OpenAI-compatible HTTP server over an Engine that keeps documents prefilled."""
