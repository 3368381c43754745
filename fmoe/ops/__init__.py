"""fmoe.ops: differentiable primitives, one private module each (setup_context autograd Functions that
work under torch.func; weight-bearing ones can defer their weight grads to the tape).

Public names only; a module's internals are reached as `fmoe.ops._linear` and so on.
"""

from fmoe.ops._attention import attention as attention
from fmoe.ops._attention import document_mask as document_mask
from fmoe.ops._attention import rope as rope
from fmoe.ops._attention import sdpa as sdpa
from fmoe.ops._cross_entropy import cross_entropy as cross_entropy
from fmoe.ops._dtypes import cast as cast
from fmoe.ops._dtypes import compute_dtype as compute_dtype
from fmoe.ops._embedding import embedding as embedding
from fmoe.ops._grouped_linear import Counts as Counts
from fmoe.ops._grouped_linear import available_backends as available_backends
from fmoe.ops._grouped_linear import group_counts as group_counts
from fmoe.ops._grouped_linear import grouped_linear as grouped_linear
from fmoe.ops._grouped_linear import traced as traced
from fmoe.ops._linear import linear as linear
from fmoe.ops._local_experts import local_experts as local_experts
from fmoe.ops._local_experts import local_experts_pay as local_experts_pay
from fmoe.ops._mlp_products import grouped_linear_pair as grouped_linear_pair
from fmoe.ops._mlp_products import linear_pair as linear_pair
from fmoe.ops._mlp_products import swiglu_grouped_linear as swiglu_grouped_linear
from fmoe.ops._mlp_products import swiglu_linear as swiglu_linear
from fmoe.ops._mlp_products import swiglu_packed_grouped_linear as swiglu_packed_grouped_linear
from fmoe.ops._permute import Layout as Layout
from fmoe.ops._permute import expert_counts as expert_counts
from fmoe.ops._permute import permute as permute
from fmoe.ops._permute import permute_probs as permute_probs
from fmoe.ops._permute import sort_layout as sort_layout
from fmoe.ops._permute import unpermute as unpermute
from fmoe.ops._rms_norm import rms_norm as rms_norm
from fmoe.ops._swiglu import halves as halves
from fmoe.ops._swiglu import swiglu as swiglu
from fmoe.ops._swiglu import swiglu_packed as swiglu_packed
