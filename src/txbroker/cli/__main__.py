"""``python -m txbroker.cli``: the ``txbroker`` command (:func:`txbroker.cli.main`)."""

from txbroker.cli import main

if __name__ == "__main__":  # importing this module (pkgutil.walk_packages does) runs nothing
    main()
