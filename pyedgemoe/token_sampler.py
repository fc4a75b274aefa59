"""One generation's sampler: llama.cpp's sampler chain (the native Sampler that
generation.SamplingParams.sampler makes) and llama-cpp-python's two Python hooks around it.

- logits_processor(input_ids, logits) -> logits: changes a step's logits before the chain sees them
  (llama-cpp-python's LogitsProcessorList, any such callable, or a list of them, applied in
  turn, as llama-cpp-python applies a plain list too); input_ids are the tokens
  evaluated so far (prompt and generated), int32, logits the step's, float32 [n_vocab], a copy the
  processor may change in place.
- stopping_criteria(input_ids, logits) -> bool: asked after each pick with the same input_ids and
  the logits the pick came from (before the processor); true ends the generation with that pick
  dropped, finish reason "stop", as llama-cpp-python's generate does.

And llama-server's reasoning control: an Event another thread sets to end the thought being written
(the chain's reasoning budget forces its end from the next pick on), once.

LogitsProcessorList and StoppingCriteriaList are llama-cpp-python's, for code that imports them.
"""
from __future__ import annotations

import numpy as np

from pyedgemoe.errors import InvalidOptionError, PyEdgeMoEError


class TokenSampler:
    """Picks a generation's tokens: pick() after each decode; `stopped` after a pick the stopping
    criteria ended the generation at."""

    def __init__(self, chain, logits_processor=None, stopping_criteria=None, reasoning_control=None):
        self.chain = chain
        self.reasoning_control = reasoning_control
        self.logits_processor = LogitsProcessorList(logits_processor) \
            if isinstance(logits_processor, (list, tuple)) else logits_processor
        self.stopping_criteria = stopping_criteria
        self.stopped = False

    def accept_prompt(self, token: int) -> None:
        """A prompt's token, for the chain's penalties."""
        self.chain.accept_prompt(token)

    def pick(self, context, i: int, ids: list[int]) -> int:
        """The token after ids (the tokens evaluated), from output i of context's last decode."""
        if self.reasoning_control is not None and self.reasoning_control.is_set():
            self.chain.end_reasoning()
            self.reasoning_control = None
        if self.logits_processor is None and self.stopping_criteria is None:
            return self._sample(context, i)
        logits, input_ids = context.output_logits(i), np.array(ids, dtype=np.intc)
        if self.logits_processor is None:
            token = self._sample(context, i)
        else:  # the processor may change its logits in place: the stopping criteria's are the pick's own
            mine = logits.copy() if self.stopping_criteria is not None else logits
            changed = np.asarray(self.logits_processor(input_ids, mine), dtype=np.float32)
            if changed.shape != logits.shape:
                raise InvalidOptionError(f"logits_processor returned logits of shape {changed.shape}, not "
                                         f"{logits.shape}")
            if np.isnan(changed).any() or not (changed > -np.inf).any():  # the chain would pick garbage
                raise InvalidOptionError("logits_processor returned logits with NaN, or with no token left "
                                         "(every logit -inf)")
            token = self._sample(context, np.ascontiguousarray(changed))
        if self.stopping_criteria is not None:
            self.stopped = bool(self.stopping_criteria(input_ids, logits))
        return token

    def _sample(self, context, output) -> int:
        """The chain's pick from output (an index of the last decode's outputs, or logits); a
        grammar that allows no token there is an InvalidOptionError."""
        try:
            return self.chain.sample_logits(context, output) if isinstance(output, np.ndarray) \
                else self.chain.sample(context, output)
        except ValueError as e:
            logits = output if isinstance(output, np.ndarray) else context.output_logits(output)
            if np.isnan(logits).any() or np.isposinf(logits).any():  # no grammar's fault
                raise PyEdgeMoEError("the model's logits are no numbers (NaN or infinite): its weights, or a LoRA "
                                     "adapter's values or scale, overflow float32") from None
            raise InvalidOptionError(str(e)) from None


class LogitsProcessorList(list):
    """llama-cpp-python's: one logits processor of several, each given the logits the one before returned."""

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(list):
    """llama-cpp-python's: one stopping criterion of several, true where any of them is."""

    def __call__(self, input_ids: np.ndarray, logits: np.ndarray) -> bool:
        return any([criterion(input_ids, logits) for criterion in self])
