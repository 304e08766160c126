"""Alias for one release: `python -m flows.demo` is now `python -m devstack.demo` (`make demo`)."""

if __name__ == "__main__":
    import sys

    from devstack.demo import main

    sys.exit(main())
