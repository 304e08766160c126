"""Alias for one release: `python -m tasks.tracking` is now `python -m integrations.tracking`."""

if __name__ == "__main__":
    import sys

    from integrations.tracking import main

    sys.exit(main())
