from llmserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
