"""quill: a small, measurable LLM inference engine and OpenAI-compatible server."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy so that `import quill` (and `quill --help`) stays fast and torch-free.
    if name == "LLM":
        from quill.llm import LLM

        return LLM
    if name == "SamplingParams":
        from quill.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
