"""``python -m range_connector.cli``: the same as the ``range-connector`` command."""

from range_connector.cli import main

raise SystemExit(main())
