"""The experiment behind each notebook, one module per notebook, each taking one frozen parameter object
(`report.params.StudyParams`) and returning tidy tables that `report.plots` draws.

| notebook | module |
|---|---|
| 01_over_smoothing | `over_smoothing` |
| 02_head_removal | `head_removal` |
| 03_alpha_search | `alpha_search` |
| 04_long_context_timing | `long_context_timing` |
| 05_ablations | `ablations` |
| 06_baselines | `frontier` |
| 07_head_importance | `head_importance` |
| 08_evaluation | `evaluation` |
| 09_scale | `scale` |
| 10_recovery | `recovery` |
| 11_retrieval_heads | `retrieval_heads` |

Studies import the capability subpackages of `harp_src` (and `checkpoints.load_model`), never each other; 06, 09, 10
and 11 share their machinery through `harp_src.compare`. The long ones (03 and 06–11, every study whose full profile
takes more than 30 min) are declared as graphs of stored steps (`harp_src.steps`), listed by `graphs()`.
"""

from .alpha_search import AlphaSearchParams, alpha_graph
from .evaluation import EvaluationParams, evaluation_graph
from .frontier import FrontierParams, frontier_graph
from .head_importance import HeadImportanceParams, head_importance_graph
from .recovery import RecoveryParams, recovery_graph
from .retrieval_heads import RetrievalParams, retrieval_graph
from .scale import ScaleParams, scale_graph


def graphs() -> dict:
    """{notebook: (its parameter class, its graph function)} of the studies declared as graphs of steps: the runner
    runs their steps on an executor before the notebooks render them."""
    return {"03_alpha_search": (AlphaSearchParams, alpha_graph), "06_baselines": (FrontierParams, frontier_graph),
            "07_head_importance": (HeadImportanceParams, head_importance_graph),
            "08_evaluation": (EvaluationParams, evaluation_graph), "09_scale": (ScaleParams, scale_graph),
            "10_recovery": (RecoveryParams, recovery_graph),
            "11_retrieval_heads": (RetrievalParams, retrieval_graph)}
