"""What eval-drift, quantize and verify read, refused in one line when it is wrong and read when
it is right (docs/guarantees.md): a --states-anchors entry that is not an integer; a d2t that
does not map every draft id to its own target id; a speculators config qstream does not know;
and the shipped pair (examples/gsm8k-pair: a speculators-layout draft without a tokenizer or a
target_num_hidden_layers) through capture --export vllm, eval-drift and quantize + verify,
with --target supplying what the draft lacks.  The simulated formats follow the draft
architecture's serving rules through the public call."""

from __future__ import annotations

import json

import pytest
import torch

from qstream.errors import QStreamError
from qstream.eval.corpus import Corpus, read_anchor_plan


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("entry", "named"),
    [([0, 5.5], "anchor 5.5"), ([0, True], "anchor true"), ([0.0, 5], "stream 0.0"),
     (["0", 5], 'stream "0"')],
)  # fmt: skip
def test_an_anchor_that_is_not_an_integer_is_refused(tmp_path, entry, named):
    corpus = Corpus("c", "0", (torch.arange(40),))
    path = tmp_path / "anchors.json"
    path.write_text(json.dumps({"blocks": [[0, 3], entry]}))
    with pytest.raises(QStreamError) as refused:
        read_anchor_plan(path, corpus, 7)
    message = str(refused.value)
    assert message.startswith(f"{path}: block 1 ") and f"{named} is not an integer" in message
