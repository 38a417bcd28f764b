"""What ctxpar's tests and benchmarks share (as torch.testing is for torch's).

    from ctxpar.testing import run_distributed, reference_attention, tolerance

- distributed: ``run_distributed``, the one harness that runs a function on N local ranks
  (gloo on CPU, NCCL on GPUs) with a timeout and the failing rank's traceback;
- attention: the fp32 references, tolerances and shared inputs the CP attention tests use;
- mla: a reference MLA layer (DeepseekV3Attention's projections around latent_attention),
  MLA inputs and the expanded-K,V reference;
- generation: the no-cache decoding reference;
- memory: ``saved_tensor_bytes``, what autograd keeps for backward;
- results: ``save_results``, a benchmark's rows as JSON with where and when.

Imports ctxpar only (never models/, tools/ or tests/): a model comes in as an argument.
"""
from ctxpar.testing.attention import reference_attention, tolerance
from ctxpar.testing.distributed import run_distributed
from ctxpar.testing.generation import reference_generate
from ctxpar.testing.memory import forward_saved_bytes, saved_tensor_bytes
from ctxpar.testing.results import save_results

__all__ = ["run_distributed", "reference_attention", "tolerance", "reference_generate",
           "saved_tensor_bytes", "forward_saved_bytes", "save_results"]
