"""Beam search in the engine core: the hook-layer feature and what it owns.

- ``feature.py``: the hook-layer feature: group lifecycle, steps;
- ``group.py``: a group's state, a beam's request;
- ``members.py``: a search's root and member requests, by id; spawning;
- ``live.py``: live beams, one engine request per beam for the whole search
  (the live step strategy);
- ``fork.py``: one new request per beam per step, ranked on the host (the
  fork step strategy);
- ``gate.py``: a step is admitted whole;
- ``policies.py``: plain beams or beams in a SID catalog, one object per group.
"""
