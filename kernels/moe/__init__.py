"""MoE FFN kernels: sigmoid router with quantile balancing, token permutation, grouped SwiGLU experts."""
from .balance import QuantileBalancer
from .grouped_gemm import grouped_mm
from .layer import MoELayer, step_moe_balance
from .naive import naive_bias_update, naive_moe
from .permute import RoutingPlan, combine, permute, plan_routing
from .router import Routing, route
from .stats import LoadStats
from .swiglu import swiglu

__all__ = [
    "LoadStats",
    "MoELayer",
    "QuantileBalancer",
    "Routing",
    "RoutingPlan",
    "combine",
    "grouped_mm",
    "naive_bias_update",
    "naive_moe",
    "permute",
    "plan_routing",
    "route",
    "step_moe_balance",
    "swiglu",
]
