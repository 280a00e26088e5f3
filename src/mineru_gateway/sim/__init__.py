"""The vLLM simulator (`mineru-gateway sim`): a stand-in for one NPU worker that speaks vLLM's
OpenAI protocol and paces its answers like a continuous-batching engine (see `config` for the
910B/MinerU2.5 assumptions, `engine` for the scheduler, `app` for the routes)."""

from mineru_gateway.sim.app import create_sim_app
from mineru_gateway.sim.config import SimConfig, add_sim_arguments, sim_config_from_args

__all__ = ["SimConfig", "add_sim_arguments", "create_sim_app", "sim_config_from_args"]
