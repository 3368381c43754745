"""fmoe.ops: differentiable primitives (setup_context autograd Functions; weight grads deferrable)."""

from fmoe.ops.attention import attention as attention
from fmoe.ops.attention import rope as rope
from fmoe.ops.cross_entropy import cross_entropy as cross_entropy
from fmoe.ops.embedding import embedding as embedding
from fmoe.ops.grouped_linear import available_backends as available_backends
from fmoe.ops.grouped_linear import grouped_linear as grouped_linear
from fmoe.ops.linear import linear as linear
from fmoe.ops.rms_norm import rms_norm as rms_norm
from fmoe.ops.swiglu import swiglu as swiglu
