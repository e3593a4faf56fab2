"""Engine-side beam search: beams fork their parent beam's KV blocks."""
