"""`python -m epd_gateway` is the `epd-gateway` command."""

from epd_gateway.cli import main

main()
