"""``python -m envsync``: the same as the ``envsync`` command."""

from envsync.cli import main

if __name__ == "__main__":
    main()
