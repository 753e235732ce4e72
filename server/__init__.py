"""The OpenAI-compatible HTTP server (Sanic): `jaxllm serve --model DIR`, or create_app for embedding."""

# the server's timing defaults live here, where the command line reads them before importing the engine
DEFAULT_RESPONSE_TIMEOUT_S = 3600.0  # a non-streamed answer writes nothing until it is done
DEFAULT_SSE_KEEPALIVE_S = 5.0  # seconds of silence after which a stream gets a `: ping` comment


def check_sse_keepalive(seconds: float) -> float:
    """seconds, if > 0 (not NaN): a stream with a 0 s keep-alive pings without a pause, never reading its output."""
    if not seconds > 0:
        raise ValueError(f"the SSE keep-alive interval must be > 0 seconds, got {seconds}")
    return seconds
