"""Answer paths (``--chunk-attention paths``) and choose-then-combine (``choose``).

- ``modes.py``: the modes and field; a chunked prompt's layout (head,
  documents, tail, question), one path per document and its score;
- ``ballot.py``: a request's paths until all are scored, and the decision
  (the likeliest, or every document close to it);
- ``voting.py``: the paths' scoring requests, and the request held until
  its kept documents become its prompt.
"""
