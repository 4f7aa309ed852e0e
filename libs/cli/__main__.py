"""``python -m libs.cli``: the ``t2i`` command without the installed script."""

from libs.cli.app import main

main()
