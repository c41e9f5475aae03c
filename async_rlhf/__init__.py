"""async-rlhf: asynchronous off-policy RLHF with vLLM generators, a Redis experience stream and
DeepSpeed learners."""

__version__ = "0.1.0"
