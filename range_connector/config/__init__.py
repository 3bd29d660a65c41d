"""The config tree, parsed once from ``kv_connector_extra_config``.

``keys`` declares every key (the source of ``docs/configuration.md``, rendered by ``reference``), ``parse`` checks
the user's mapping against the declarations, ``tree`` holds the frozen result (:class:`RangeConfig` with one
:class:`TierConfig` per tier), ``paths`` the runtime directory's default. Unknown keys, bad values and contradictory
settings raise :class:`~range_connector.errors.ConfigError` naming the key, at start-up, in every vLLM process that
builds a connector. The flat keys of earlier versions (``backend``, ``valkey_urls``, ...) still work as a one-tier
shorthand, with a deprecation warning that names the new spelling.

Imports nothing of the project but ``errors``.
"""

from range_connector.config.keys import LOAD_MODES, SAVE_MODES, TIER_TYPES
from range_connector.config.tree import RangeConfig, TierConfig, TierSecurity, TierTesting

__all__ = ["LOAD_MODES", "SAVE_MODES", "TIER_TYPES", "RangeConfig", "TierConfig", "TierSecurity", "TierTesting"]
