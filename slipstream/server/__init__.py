"""OpenAI-compatible HTTP server: `build_app(engine, served_model_name, api_key)`."""
from slipstream.server.app import build_app

__all__ = ["build_app"]
