"""The HTTP API (FastAPI) and running it under uvicorn."""
