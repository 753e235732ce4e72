"""The OpenAI-compatible HTTP server (Sanic): `jaxllm serve --model DIR`, or create_app for embedding."""
