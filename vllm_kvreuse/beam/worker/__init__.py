"""A beam step next to the logits, in the workers (torch, runner-agnostic
but for the runners' patches).

- ``job.py``: a step's groups inside the sampler; a live group's beams as
  worker state across steps;
- ``select.py``: a group's step on the logits' device: the next beams and
  which member carries each;
- ``runner_hooks.py``: both model runners' samplers run the step's groups
  (registered patches; the one module that reads runner state).
"""
