"""Train BC from a chunk dataset through RLlib's offline API for one iteration, then end as a user's script does:
``python rllib_offline_exit.py DIR [exit|shutdown]`` (``shutdown``: ``ray.shutdown()`` before the end). Its
console must end clean (``tests/integrations/test_rllib_offline.py``)."""
import importlib.util
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import ray  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def main(out: str, end: str) -> None:
    spec = importlib.util.spec_from_file_location("rllib_finetune", REPO / "pipelines" / "rllib_finetune.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    ray.init(address="local", num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             log_to_driver=False, logging_level=logging.WARNING)
    import gymnasium as gym
    from ray.rllib.algorithms.bc import BCConfig

    from rayrb.integrations.rllib import ChunkOfflineData, write_episodes

    episodes, _ = job.log_behaviour(2, 0, 0.0)
    root = str(write_episodes(episodes, Path(out) / "log").root)
    env = gym.make("CartPole-v1")
    config = (BCConfig().environment(observation_space=env.observation_space, action_space=env.action_space)
              .offline_data(input_=root, offline_data_class=ChunkOfflineData, dataset_num_iters_per_learner=2,
                            map_batches_kwargs={"concurrency": 1, "num_cpus": 0})
              .training(train_batch_size_per_learner=64).debugging(seed=0, log_level="ERROR"))
    algo = config.build_algo()
    algo.train()
    algo.stop()
    if end == "shutdown":
        ray.shutdown()
    print("RAYRB_DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "exit")
