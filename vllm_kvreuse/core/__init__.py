"""The scheduler hook layer and the services features share.

- :mod:`.layer`: the one class that overrides upstream ``Scheduler`` methods,
  each once, and calls features through named hooks in a declared order.
- :mod:`.feature`: the hooks a feature may implement (a plain object).
- :mod:`.ledger`: blocks held past their request's life, and inheritance.
- :mod:`.internal`: requests the plugin adds for itself.
- :mod:`.accounting`: the block-accounting invariant, checked by tests.
"""
