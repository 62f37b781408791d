"""Draft tokens from a request's predicted output (OpenAI's Predicted Outputs: `prediction`, text the answer is
expected to repeat much of, such as a file being edited). The scheduler has them verified as any speculative
drafts are, so the output is exactly what it would be without the prediction, only sooner where the two agree.

Where the output is in the prediction is found by looking up the output's last tokens (its longest suffix of up
to MAX_MATCH_TOKENS that occurs there) at or after where the previous draft came from: an edit that inserts text
loses the place until the output comes back to text the prediction has, and a prediction that repeats a line is
followed forward, not back to its first copy. The tokens after that place are the draft."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The longest draft a prediction gives one step; on a CPU, less where a step of more tokens leaves its fast path.
PREDICTION_DRAFT_TOKENS = 16
MAX_MATCH_TOKENS = 8


def draft_from_prediction(prediction: np.ndarray, output: Sequence[int], cursor: int, limit: int) -> tuple[list[int], int]:
    """Up to `limit` tokens of `prediction` to follow `output` (the tokens generated so far, at least one), and the
    new cursor (where in the prediction the output ends, to look from next time; `cursor` is the last one)."""
    ends = _match_ends(prediction, output)
    if not len(ends) or limit < 1:
        return [], cursor
    ahead = ends[ends >= cursor]
    end = int(ahead[0] if len(ahead) else ends[-1])
    return prediction[end:end + limit].tolist(), end


def _match_ends(prediction: np.ndarray, output: Sequence[int]) -> np.ndarray:
    """The positions just past each occurrence in `prediction` of the longest suffix of `output` found there."""
    ends = np.flatnonzero(prediction == output[-1]) + 1
    for back in range(1, min(MAX_MATCH_TOKENS, len(output))):
        before = ends - 1 - back
        longer = ends[(before >= 0) & (prediction[np.maximum(before, 0)] == output[-1 - back])]
        if not len(longer):
            break
        ends = longer
    return ends
