"""`python -m jaxllm.server serve ...` runs the same command line as `jaxllm serve ...`."""

from jaxllm.server.cli import main

main()
