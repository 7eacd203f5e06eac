"""The job's learners: a reward model ``Q(x, a)`` trained as a Ray actor (``Learner``) or as RLlib's
``LearnerGroup`` (``GroupLearner``), and the driver-side calls that treat both alike.

The model is an MLP with one logit per action, fitted to the observed rewards of the actions taken; the greedy
policy is ``argmax_a Q(x, a)``. Only ``--input rllib`` imports RLlib (``rllib_classes``).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import ray

if TYPE_CHECKING:
    import torch
    from ray.actor import ActorHandle

    from rayrb import OfflineToOnlineReplayBuffer


def make_model(n_features: int, n_actions: int, hidden: int) -> torch.nn.Module:
    """The reward model: one logit per action (the learners' and the collectors')."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(n_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n_actions))


@ray.remote(num_cpus=1)
class Learner:
    """The reward model and its optimizer; trains on fed slices or on batches it pulls itself."""

    def __init__(self, rb, test_root: str, n_features: int, n_actions: int, hidden: int, lr: float, seed: int):
        import torch

        from rayrb import ChunkDataset

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.rb = rb
        self.model = make_model(n_features, n_actions, hidden)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        test = ChunkDataset.open(test_root).read()
        self.test_x, self.test_y = torch.from_numpy(test["X"]), torch.from_numpy(test["y"])

    def _step(self, td, info) -> tuple[float, int]:
        import torch

        q = self.model(td["observation"]).gather(-1, td["action"].unsqueeze(-1))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(q, td["next", "reward"])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item(), int(info["offline"].sum())

    def update(self, plan, *parts) -> tuple[float, int, int]:
        """``rb.feed("update")`` calls this with this learner's slice, straight from the shards."""
        from rayrb.actors.transport import receive

        td, info = receive(plan, *parts)
        loss, n_off = self._step(td, info)
        return loss, n_off, td.batch_size[0]

    def train(self, steps: int, batch_size: int) -> list[tuple[float, int, int]]:
        """Pull ``steps`` batches through the buffer's prefetching iterator and train on each."""
        out = []
        for td, info in self.rb.iter_batches(batch_size, prefetch=4, return_info=True, num_batches=steps):
            loss, n_off = self._step(td, info)
            out.append((loss, n_off, td.batch_size[0]))
        return out

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def evaluate(self) -> float:
        """Held-out greedy accuracy: the mean reward of ``argmax_a Q(x, a)`` on rows never trained on."""
        import torch

        with torch.no_grad():
            return float((self.model(self.test_x).argmax(-1) == self.test_y).float().mean())


# RLlib column -> logged key: what the reward model reads.
REWARD_COLUMNS = {"obs": "observation", "actions": "action", "rewards": "next/reward"}


@functools.cache
def rllib_classes() -> tuple[type, type]:
    """The reward model as an RLlib ``TorchRLModule`` and its ``TorchLearner``; only ``--input rllib`` imports RLlib."""
    try:
        import torch
        from ray.rllib.core import DEFAULT_MODULE_ID
        from ray.rllib.core.columns import Columns
        from ray.rllib.core.learner.torch.torch_learner import TorchLearner
        from ray.rllib.core.rl_module.torch import TorchRLModule
        from ray.rllib.utils.metrics import TD_ERROR_KEY
    except ImportError as e:
        raise ImportError(f"--input rllib expects RLlib to be installed (pip install 'rayrb[rllib]'), "
                          f"got {type(e).__name__}: {e}") from e

    class RewardModule(TorchRLModule):
        """``make_model``'s MLP: one reward logit per action."""

        def setup(self) -> None:
            self.q = make_model(self.observation_space.shape[0], self.action_space.n, self.model_config["hidden"])

        def _forward(self, batch: dict, **kwargs) -> dict:
            return {"q": self.q(batch[Columns.OBS])}

    class RewardLearner(TorchLearner):
        """``Learner._step``'s loss; RLlib's default optimizer is the same Adam at ``config.lr``."""

        def build(self) -> None:
            torch.set_num_threads(1)  # as the actor learner: one CPU
            super().build()
            self._test = None

        def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
            q = fwd_out["q"].gather(-1, batch[Columns.ACTIONS].long().unsqueeze(-1))
            reward = batch[Columns.REWARDS].float().unsqueeze(-1)
            # A bandit's TD error is r - Q(x, a): one per row, as rayrb.integrations.rllib.update expects.
            self.metrics.log_value((module_id, TD_ERROR_KEY), (reward - torch.sigmoid(q)).detach().squeeze(-1),
                                   reduce="item_series")
            return torch.nn.functional.binary_cross_entropy_with_logits(q, reward)

        def evaluate(self) -> float:
            """``Learner.evaluate`` on this learner's module."""
            from rayrb import ChunkDataset

            if self._test is None:
                test = ChunkDataset.open(self.config.learner_config_dict["test_root"]).read()
                self._test = torch.from_numpy(test["X"]), torch.from_numpy(test["y"])
            x, y = self._test
            with torch.no_grad():
                return float((self.module[DEFAULT_MODULE_ID].q(x).argmax(-1) == y).float().mean())

    return RewardModule, RewardLearner


class GroupLearner:
    """``Learner`` run as RLlib's ``LearnerGroup`` (new API stack, one remote learner with one CPU).

    Batches are sampled by rayrb and reach the learner as ``MultiAgentBatch`` refs through
    ``rayrb.integrations.rllib.update``, straight from the shards.
    """

    def __init__(self, rb, test_root: str, n_features: int, n_actions: int, hidden: int, lr: float, seed: int):
        import gymnasium as gym
        from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
        from ray.rllib.core import DEFAULT_MODULE_ID
        from ray.rllib.core.rl_module.rl_module import RLModuleSpec

        module_cls, learner_cls = rllib_classes()
        config = (AlgorithmConfig()
                  .learners(num_learners=1, num_cpus_per_learner=1, learner_class=learner_cls,
                            learner_config_dict={"test_root": test_root})
                  .training(lr=lr)
                  .debugging(seed=seed))
        spec = RLModuleSpec(module_class=module_cls,
                            observation_space=gym.spaces.Box(-np.inf, np.inf, (n_features,), np.float32),
                            action_space=gym.spaces.Discrete(n_actions), model_config={"hidden": hidden})
        self.rb, self.module_id, self.rows, self.stopped = rb, DEFAULT_MODULE_ID, 0, False
        self.group = config.build_learner_group(rl_module_spec=spec)

    def train(self, steps: int, batch_size: int) -> list[tuple[float, int, int]]:
        """``steps`` updates, each on one batch sampled by rayrb; ``(loss, offline rows, rows)`` for each."""
        from ray.rllib.core.learner.learner import Learner as RLlibLearner
        from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

        from rayrb.integrations.rllib import update

        out = []
        for _ in range(steps):
            self.rows += batch_size
            res = update(self.group, self.rb, batch_size, columns=REWARD_COLUMNS,
                         timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: self.rows})
            loss = res.results[0][self.module_id][RLlibLearner.TOTAL_LOSS_KEY]
            out.append((float(loss.peek() if hasattr(loss, "peek") else loss), int(res.info["offline"].sum()),
                        int(res.info["index"].shape[0])))
        return out

    def weights(self) -> ray.ObjectRef:
        """The module's weights as ``make_model``'s state dict, in the object store for the collectors."""
        import torch

        state = self.group.get_weights([self.module_id])[self.module_id]
        return ray.put({k.split(".", 1)[1]: torch.tensor(v) for k, v in state.items()})  # drop the "q." prefix

    def evaluate(self) -> float:
        """Held-out greedy accuracy, computed on the remote learner."""
        return next(r.get() for r in self.group.foreach_learner(lambda learner: learner.evaluate()))

    def shutdown(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.group.shutdown()


# ---------------------------------------------------------------------------- either learner, from the driver
def make_learner(how: str, rb: OfflineToOnlineReplayBuffer, test_root: str, n_features: int, n_actions: int,
                 hidden: int, lr: float, seed: int) -> ActorHandle | GroupLearner:
    """A ``GroupLearner`` for ``--input rllib``, else a ``Learner`` actor (the learner in the calls below)."""
    make = GroupLearner if how == "rllib" else Learner.remote
    return make(rb, test_root, n_features, n_actions, hidden, lr, seed)


def weights(learner: ActorHandle | GroupLearner) -> ray.ObjectRef:
    """The learner's weights as one object ref, read by every collector from the object store."""
    return learner.weights() if isinstance(learner, GroupLearner) else learner.weights.remote()


def train_block(how: str, rb: OfflineToOnlineReplayBuffer, learner: ActorHandle | GroupLearner, steps: int,
                batch_size: int) -> list[tuple[float, int, int]]:
    """``steps`` updates as ``--input`` says; ``(loss, offline rows, rows)`` for each."""
    if how == "feed":  # rb.feed() hands the learner actor its slices
        return [rb.feed("update")[0] for _ in range(steps)]
    if isinstance(learner, GroupLearner):
        return learner.train(steps, batch_size)
    return ray.get(learner.train.remote(steps, batch_size))


def evaluate(learner: ActorHandle | GroupLearner) -> float:
    """The learner's held-out greedy accuracy."""
    return learner.evaluate() if isinstance(learner, GroupLearner) else ray.get(learner.evaluate.remote())


def stop(actor: ActorHandle | GroupLearner) -> None:
    """Kill an actor, or shut a ``GroupLearner``'s learners down (again is harmless)."""
    if isinstance(actor, GroupLearner):
        actor.shutdown()
    else:
        ray.kill(actor)
