"""The scheduler hook layer and the services features share.

- :mod:`.layer`: the one class that overrides upstream ``Scheduler`` methods,
  each once, and calls features through named hooks in a declared order.
- :mod:`.feature`: the hooks a feature may implement (a plain object).
- :mod:`.spec`: what a feature declares (``FeatureSpec``): options, request
  keys, switch, scheduler class, engine and frontend hooks; each feature
  folder's ``spec.py`` has one.
- :mod:`.options`: one server option (``Option``) and the value parsers.
- :mod:`.features`: builds the enabled features, in the top floor's order.
- :mod:`.context`: what every feature receives: the scheduler, the services.
- :mod:`.ledger`: blocks held past their request's life, and inheritance.
- :mod:`.internal`: requests the plugin adds for itself.
- :mod:`.resend`: running requests sent whole to the workers again.
- :mod:`.holds`: requests features hold out of vLLM's queues; the one
  owner of their moves out and back.
- :mod:`.upstream`: the one seam to vLLM's internal state, a module a
  side: scheduler, a request's state, frontend, worker (each attribute
  registered per vLLM release).
- :mod:`.request_keys`: every internal ``extra_args`` key, and its seal.
- :mod:`.accounting`: the block-accounting invariant, checked by tests.
"""
