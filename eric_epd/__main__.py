"""`python -m eric_epd ...` is the same as the `eric-epd` command."""

from eric_epd.cli import main

if __name__ == "__main__":
    main()
