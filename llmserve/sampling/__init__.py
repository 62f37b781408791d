from llmserve.sampling.params import RequestOutputKind, SamplingParams

__all__ = ["RequestOutputKind", "SamplingParams"]
