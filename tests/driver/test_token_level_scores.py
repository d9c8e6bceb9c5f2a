"""Where a sequence's score lands: on the last token the response mask covers, also when the mask has holes
(a multi-turn trajectory: tool results and template glue are context, not trained)."""

from __future__ import annotations

import torch

from rlhf.driver.rl.advantages import token_level_scores
from workers.batch import Batch


def test_score_on_the_last_covered_token():
    mask = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0],  # one turn, right-padded
        [1, 1, 0, 0, 1, 1, 0],  # two model turns around a tool result
        [1, 0, 0, 0, 0, 0, 1],  # the hole wider than the second turn
        [0, 0, 0, 0, 0, 0, 0],  # nothing generated
    ])
    batch = Batch({"response_mask": mask, "scores": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    out = token_level_scores(batch)
    want = torch.zeros(mask.shape)
    want[0, 2], want[1, 5], want[2, 6] = 1.0, 2.0, 3.0
    torch.testing.assert_close(out, want)
