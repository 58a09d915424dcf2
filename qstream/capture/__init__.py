"""``qstream capture``: the target's hidden states, captured with transformers (docs/capture.md).

* :mod:`qstream.capture.target` loads a Hugging Face target (local files only) and checks the
  draft against it;
* :mod:`qstream.capture.hooks` taps exactly the draft's ``target_layer_ids`` decoder layers and
  the final norm;
* :mod:`qstream.capture.streams` makes the token streams: the corpus as written, or the
  target's own samples (``--generate``);
* :mod:`qstream.capture.layout` writes each batch's tapped states, one file per stream, in
  qstream's layout or vLLM's / speculators' (``--export vllm``), with ``capture.json`` for
  resuming;
* :mod:`qstream.capture.run` puts these together, a batch of streams at a time.
"""
