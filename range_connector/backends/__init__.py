"""Storage tiers behind one protocol (see :mod:`range_connector.backends.base`)."""
