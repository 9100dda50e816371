"""Horizontal fusion for PyTorch: :class:`FusibleTrainer` and :class:`TorchFusedGroup`.

A :class:`FusibleTrainer` hands its training loop to stagetree. The user writes
``__init__`` (model(s), *one* ``torch.optim`` optimizer -- ``SGD``, ``Adam``, ``AdamW``
or ``Adadelta`` with one param group --, a :class:`~stagetree.torch.StageLoader`),
``loss(batch)`` and ``evaluate()``::

    class MyTrainer(FusibleTrainer):
        def __init__(self, config):
            super().__init__(config)
            self.model = make_model(config)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.loader = StageLoader((x, y), batch_size=32, seed=config["seed"])

        def loss(self, batch):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def evaluate(self):
            ...

and its ``train()`` is, ``updates_per_step`` times: ``.train()`` on every module the
trainer checkpoints, ``batch = self.next_batch()``, ``loss = self.loss(batch)``,
``optimizer.zero_grad(set_to_none=True)``, ``loss.backward()``, ``optimizer.step()``;
it returns ``{"train_loss": mean of the losses}``. Because stagetree owns that loop it can
run it for B sibling members at once (:meth:`FusibleTrainer.fuse`): their modules are
stacked with ``torch.func.stack_module_state``, ``loss`` runs once under
``vmap(functional_call)`` over the same batch, one backward gives every member's
gradients and one fused optimizer step (:mod:`stagetree.torch.fused_optim`) updates them
all, each with its own ``lr``, ``momentum``...

**What may differ between members** (:attr:`FusibleTrainer.fusible`): the optimizer
scalars ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``betas`` / ``beta1`` /
``beta2``, ``eps`` and ``rho``. Everything else is shared, so it is *not* fusible: ``batch_size``
and any other name ``setup`` receives, the fixed config (architecture, dropout
probability, optimizer kind), the data order and every RNG stream. A subclass whose
``setup`` reads a fusible name for something else than the optimizer must remove it
from ``fusible``.

**What a fused member equals.** Member ``b`` is the member trained alone up to
floating-point reassociation (batched kernels sum in another order): no dropout, no other
randomness in ``loss``, and the member's weights and optimizer state follow the unfused
ones to float32 rounding. Random draws inside ``loss`` (dropout) are independent per
member (``vmap(..., randomness="different")``) but come from the group's one stream, so a
fused member's masks are not the ones it would have drawn alone. BatchNorm keeps running
statistics per member: the buffers are stacked like the parameters and its in-place
updates land in each member's slice.

**HFTA's form for standard layers** (:attr:`FusibleTrainer.fused_kernels`, default
``"grouped"``): inside the fused forward, each plain ``nn.Conv2d``, ``nn.BatchNorm2d``
(with a ``momentum``), ``nn.AdaptiveAvgPool2d`` and ``nn.Linear`` of the fused modules
runs as HFTA writes B models: one convolution with ``groups=B`` over ``[N, B*C, H, W]``,
one BatchNorm over ``B*C`` channels (running statistics updated in place in each
member's slice), one pooling, one batched product (:mod:`stagetree.torch.grouped`; the
user's ``loss`` is unchanged).
With AMP each convolution casts once, and on CUDA the activations between these
layers stay channels_last (:attr:`FusibleTrainer.fused_channels_last`).
Members follow the members alone as closely as with vmap's rules (the same grouped
convolution; BatchNorm per channel as alone). Other layers, subclasses of these and
``"vmap"`` keep ``torch.func.vmap``'s own rules.

**Mixed precision** (:meth:`FusibleTrainer.enable_amp`): ``loss`` runs under
``torch.autocast`` fused or not, and with float16 each member keeps its own
``GradScaler`` scale (:mod:`stagetree.torch.amp`).

**When it pays** (``benchmarks/fusion_bench.py``, one CPU thread): vmap costs a fixed
~0.4 ms per update, so a fused job of one member is ~2.6x slower than training it alone,
and the digits MLP gains from B = 4 on (1.35x at 4, 3.9x at 16, 6.9x at 64 members).
The small CNN with BatchNorm did not gain on a CPU with vmap's rules (0.9x): its
convolutions get faster, but vmap's BatchNorm applies the affine part as separate
broadcast passes (the grouped kernels, below, run it as one BatchNorm). On a GPU a small
model's step is mostly kernel launches, which fusion shares among the members.

**What cannot be fused** (:class:`~stagetree.exceptions.FusionError`): a subclass that
overrides ``train()`` (its ``fusible`` is then empty, unless it sets it); another
optimizer than ``SGD``/``Adam``/``AdamW``/``Adadelta``, several optimizers or param groups,
``amsgrad``/``maximize``/``differentiable``; an optimized parameter outside the
checkpointed modules; and, found on the first fused step, a
``loss`` that ``vmap`` refuses (``.item()`` or data-dependent Python control flow on a
tensor, an in-place write of a per-member value into a shared tensor, ...).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from stagetree.exceptions import FusionError
from stagetree.fusion import FusedGroup
from stagetree.torch.amp import Amp, MemberScales, autocast
from stagetree.torch.fused_optim import FusedAdadelta, FusedAdam, FusedOptimizer, FusedSGD
from stagetree.torch.grouped import Kernels, install
from stagetree.torch.rng import (
    GlobalRngState,
    get_rng_object_state,
    is_rng_object,
    restore_global_rng,
    set_rng_object_state,
)
from stagetree.torch.trainer import _DEPTH, _RNG, TorchTrainer, _clone_tree
from stagetree.trainer import Trainer

__all__ = ["FusibleTrainer", "TorchFusedGroup"]


def _updates_per_step(trainer: Any) -> int:
    value = getattr(trainer, "updates_per_step", 1)
    try:
        count = operator.index(value)
    except TypeError:
        count = 0
    if count < 1:
        raise ValueError(
            f"{type(trainer).__name__}.updates_per_step must be an integer >= 1, got {value!r}"
        )
    return count


def _the_scaler(trainer: TorchTrainer, objects: Mapping[str, Any]) -> torch.amp.GradScaler | None:
    """The trainer's one enabled ``GradScaler`` (None: none)."""
    found = [o for o in objects.values() if isinstance(o, torch.amp.GradScaler) and o.is_enabled()]
    if len(found) > 1:
        raise ValueError(
            f"{type(trainer).__name__}: FusibleTrainer's train() scales with one GradScaler, "
            f"but it checkpoints {len(found)}"
        )
    return found[0] if found else None


def _the_optimizer(trainer: TorchTrainer, objects: Mapping[str, Any]) -> torch.optim.Optimizer:
    found = [obj for obj in objects.values() if isinstance(obj, torch.optim.Optimizer)]
    if len(found) != 1:
        raise ValueError(
            f"{type(trainer).__name__}: FusibleTrainer's train() steps the trainer's one "
            f"optimizer, but it checkpoints {len(found)}; override train() (the trainer "
            "is then not fusible)"
        )
    return found[0]


class FusibleTrainer(TorchTrainer):
    """A :class:`~stagetree.torch.TorchTrainer` whose training loop stagetree owns, so
    that sibling members can be trained fused (see :mod:`stagetree.torch.fused`).

    Write ``__init__`` (calling ``super().__init__(config)`` first), :meth:`loss` and
    ``evaluate``; optionally :meth:`next_batch` and :attr:`updates_per_step` (a class or
    an instance attribute). Do not override ``train()``: a subclass that does trains as
    an ordinary :class:`~stagetree.torch.TorchTrainer` (its :attr:`fusible` is empty)
    and :meth:`fuse` refuses it.
    """

    #: Optimizer scalars: the sequential hyper-parameters fused members may differ in.
    #: Not fusible: ``batch_size`` and any other name, the fixed config (architecture,
    #: dropout probability, ...), the data order.
    fusible: ClassVar[frozenset[str]] = frozenset(
        {"lr", "momentum", "weight_decay", "betas", "beta1", "beta2", "eps", "dampening", "rho"}
    )
    #: Optimizer updates (minibatches) per ``train()`` call.
    updates_per_step: int = 1
    #: Automatic mixed precision, ``(device type, dtype)`` of ``torch.autocast`` (None:
    #: off); set by :meth:`enable_amp`.
    amp: Amp | None = None
    #: How a fused job computes the plain ``nn.Conv2d`` / ``nn.BatchNorm2d`` /
    #: ``nn.AdaptiveAvgPool2d`` / ``nn.Linear`` layers: ``"grouped"`` (HFTA's form: one
    #: grouped convolution, one BatchNorm over the members' channels...; see
    #: :mod:`stagetree.torch.grouped`) or ``"vmap"`` (``torch.func.vmap``'s own rules).
    fused_kernels: str = "grouped"
    #: Grouped layers keep activations and convolution weights channels_last (None: on
    #: CUDA with AMP, where cuDNN's half-precision convolutions are fastest in it; float32
    #: keeps NCHW there, so that its kernels are the ones a member alone runs).
    fused_channels_last: bool | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Its own train() means its own loop: nothing the worker could fuse (an empty
        # `fusible` says so before fuse() is ever called), unless it says otherwise.
        if "train" in cls.__dict__ and "fusible" not in cls.__dict__:
            cls.fusible = frozenset()

    def enable_amp(
        self,
        dtype: torch.dtype | None = None,
        *,
        device: str | torch.device | None = None,
        scaler: bool | None = None,
        **scaler_args: Any,
    ) -> None:
        """Train with automatic mixed precision (call it in ``__init__``, after the model
        is on its device): :meth:`loss` runs under ``torch.autocast``, fused or not.

        Args:
            dtype: the autocast dtype; default float16 on CUDA, bfloat16 elsewhere.
            device: the autocast device; default the device of the trainer's first
                module parameter.
            scaler: scale the loss with a ``torch.amp.GradScaler`` (held as
                ``self.grad_scaler``, checkpointed); default: with float16. Fused, each
                member keeps its own loss scale.
            **scaler_args: ``GradScaler`` arguments (``init_scale``, ``growth_interval``...).
        """
        if device is None:
            params = [
                p
                for m in self.checkpointed_objects().values()
                if isinstance(m, nn.Module)
                for p in m.parameters()
            ]
            device = params[0].device if params else "cpu"
        kind = torch.device(device).type
        if dtype is None:
            dtype = torch.float16 if kind == "cuda" else torch.bfloat16
        self.amp = (kind, dtype)
        if scaler if scaler is not None else dtype == torch.float16:
            self.grad_scaler = torch.amp.GradScaler(kind, **scaler_args)

    def loss(self, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``batch`` with the trainer's modules.

        Fused, it runs under ``torch.func.vmap`` with each member's parameters swapped
        into the modules: write it as plain tensor code, without ``.item()`` or Python
        branches on tensor values, and without in-place writes into tensors that are not
        the modules' own parameters or buffers.
        """
        raise NotImplementedError(f"{type(self).__name__} must define loss(batch)")

    def next_batch(self) -> Any:
        """The next training batch: by default the ``next_batch()`` of the trainer's one
        :class:`~stagetree.torch.StageLoader`.

        Raises:
            ValueError: the trainer checkpoints no StageLoader or several (override this
                method then).
        """
        loaders = self._loaders()
        if len(loaders) != 1:
            raise ValueError(
                f"{type(self).__name__}.next_batch(): the default draws from the trainer's "
                f"one StageLoader, but it has {len(loaders)}; override next_batch()"
            )
        return loaders[0].next_batch()

    def train(self) -> dict[str, float]:
        """:attr:`updates_per_step` optimizer updates; ``{"train_loss": their mean loss}``.

        Each update: ``.train()`` on every module the trainer checkpoints, then
        :meth:`next_batch`, :meth:`loss`, ``zero_grad(set_to_none=True)``,
        ``backward()``, ``optimizer.step()``.
        """
        objects = self.checkpointed_objects()
        modules = [obj for obj in objects.values() if isinstance(obj, nn.Module)]
        optimizer = _the_optimizer(self, objects)
        scaler = _the_scaler(self, objects)
        updates = _updates_per_step(self)
        total: torch.Tensor | None = None
        for _ in range(updates):
            for module in modules:
                module.train()
            batch = self.next_batch()
            with autocast(self.amp):
                loss = self.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            # One host sync per step, at the end (not one .item() per update).
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return {"train_loss": total.item() / updates}

    @classmethod
    def fuse(cls, members: Sequence[Trainer]) -> TorchFusedGroup:
        """Train ``members`` as one job (see :class:`TorchFusedGroup`).

        Raises:
            FusionError: the members cannot be fused (the message says why).
        """
        for member in members:
            if not isinstance(member, cls):
                raise FusionError(
                    f"{cls.__qualname__}.fuse got a {type(member).__qualname__} member"
                )
        return TorchFusedGroup(members)

    def fused_width_limit(self) -> int | None:
        """On a CUDA device, how many members one fused job may hold: half the device's
        free memory over a member's state (its stacked parameters, their gradients, its
        own trainer's copy, and the fused and its own optimizer state); the other half
        is left to activations, which grow with the width too. None on a CPU (memory is
        rarely the limit there; ``max_fused`` is). A rough estimate: lower ``max_fused``
        for a model whose activations dwarf its parameters."""
        modules = [m for m in self.checkpointed_objects().values() if isinstance(m, nn.Module)]
        tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        if not tensors or tensors[0].device.type != "cuda":
            return None
        device = tensors[0].device
        free, _total = torch.cuda.mem_get_info(device)
        state = sum(t.numel() * t.element_size() for t in tensors)
        optimizer = next(
            (
                o
                for o in self.checkpointed_objects().values()
                if isinstance(o, torch.optim.Optimizer)
            ),
            None,
        )
        two = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adadelta)
        slots = 2 if isinstance(optimizer, two) else 1
        per_member = state * (3 + 2 * slots)
        return max(1, int(free // 2 // max(per_member, 1)))


# -- the fused job --------------------------------------------------------------------------


class _Holder(nn.Module):
    """The driver's fused modules as submodules; ``forward(batch)`` is its ``loss``.

    ``functional_call(holder, (params, buffers), (batch,))`` swaps one member's tensors
    into the very module objects ``loss`` uses (``self.model`` of the driver).
    """

    def __init__(self, driver: FusibleTrainer) -> None:
        super().__init__()
        self.driver = driver

    def forward(self, batch: Any) -> torch.Tensor:
        return self.driver.loss(batch)


def _has_tensors(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or (next(module.buffers(), None) is not None)


def _fused_rule(
    optimizer: torch.optim.Optimizer, where: str
) -> tuple[type[FusedOptimizer], dict[str, Any]]:
    """The fused optimizer class (and its structural arguments) for ``optimizer``."""
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adadelta):
        raise FusionError(
            f"{where}: optimizer {kind.__qualname__} has no fused form (SGD, Adam, AdamW "
            "and Adadelta have)"
        )
    if len(optimizer.param_groups) != 1:
        raise FusionError(
            f"{where}: the optimizer has {len(optimizer.param_groups)} param groups; "
            "fusion needs one"
        )
    group = optimizer.param_groups[0]
    for flag in ("amsgrad", "maximize", "differentiable"):
        if group.get(flag):
            raise FusionError(f"{where}: {kind.__name__}({flag}=True) has no fused form")
    if kind is torch.optim.SGD:
        return FusedSGD, {"nesterov": bool(group["nesterov"])}
    if kind is torch.optim.Adadelta:
        return FusedAdadelta, {}
    decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
    return FusedAdam, {"decoupled": decoupled}


def _group_hp(group: Mapping[str, Any], rule: type[FusedOptimizer]) -> dict[str, float]:
    """A torch.optim param group's values under the fused optimizer's names."""
    if rule is FusedSGD:
        return {k: float(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")}
    if rule is FusedAdadelta:
        return {k: float(group[k]) for k in ("lr", "rho", "eps", "weight_decay")}
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
    }


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays: ambiguous truth value
        return a is b


def _set_global_rng(trainer: TorchTrainer, state: GlobalRngState) -> None:
    """Make ``state`` the trainer's global RNG stream (as ``load_state_dict`` does)."""
    if trainer.__dict__.get(_DEPTH, 0) > 0:
        restore_global_rng(state)
    else:
        trainer.__dict__[_RNG] = state


class TorchFusedGroup(FusedGroup):
    """B :class:`FusibleTrainer` members trained as one job (the
    :class:`~stagetree.fusion.FusedGroup` contract).

    The group builds a private *driver* trainer: ``type(m0)(m0.config)`` restored from
    ``members[0].state_dict()``. Its loader, RNG streams (global and object),
    ``extra_state()``, schedulers and any other checkpointed object are what every member
    shares: the fused loop draws the batches and the random numbers from them. Its module
    objects are the templates ``vmap(functional_call)`` swaps each member's tensors into.
    Each member's own tensors are stacked (``torch.func.stack_module_state``): the
    modules' parameters and buffers, and its optimizer state in a
    :class:`~stagetree.torch.fused_optim.FusedSGD` / ``FusedAdam``, whose per-member
    hyper-parameters are read from the members' own optimizers (which
    :meth:`setup` configures through ``members[i].setup``) before a step that follows a
    ``setup``.

    The member trainer objects are left alone by :meth:`step` (they hold the tensors
    they were built with, and about B more copies of the parameters and optimizer state
    live in the stacks): :meth:`sync` writes member ``i``'s state into its trainer.
    Tensors stay on the members' device.

    Raises:
        FusionError: the members cannot be fused (see :mod:`stagetree.torch.fused`).
    """

    def __init__(self, members: Sequence[Trainer]) -> None:
        if len(members) < 1:
            raise FusionError("a fused group needs at least one member")
        first = members[0]
        if not isinstance(first, FusibleTrainer):
            raise FusionError(f"{type(first).__qualname__} is not a FusibleTrainer")
        kind = type(first)
        name = kind.__qualname__
        for member in members[1:]:
            if type(member) is not kind:
                raise FusionError(
                    f"members of one fused group must be of one class: {name} and "
                    f"{type(member).__qualname__}"
                )
            if not _same(member.config, first.config):
                raise FusionError(
                    f"members of one fused group must share their config: {first.config!r} "
                    f"and {member.config!r}"
                )
        if kind.train is not FusibleTrainer.train:
            raise FusionError(
                f"{name} overrides train(): stagetree does not own its training loop, so "
                "it cannot be fused (write loss() and next_batch() instead)"
            )
        self._name = name
        self._members: list[FusibleTrainer] = [first, *members[1:]]  # type: ignore[list-item]
        self._fusible = kind.fusible

        driver = kind(first.config)
        driver.load_state_dict(first.state_dict())
        self._driver = driver
        objects = driver.checkpointed_objects()
        member_objects = [m.checkpointed_objects() for m in self._members]
        for objs in member_objects:
            if list(objs) != list(objects):
                raise FusionError(
                    f"{name}: members hold different objects ({sorted(objs)} and {sorted(objects)})"
                )
        self._modules = [obj for obj in objects.values() if isinstance(obj, nn.Module)]

        # Fused modules: the checkpointed ones holding tensors, less those inside another.
        candidates = [
            n for n, obj in objects.items() if isinstance(obj, nn.Module) and _has_tensors(obj)
        ]
        inner = {
            id(sub) for n in candidates for sub in objects[n].modules() if sub is not objects[n]
        }
        fused = [n for n in candidates if id(objects[n]) not in inner]
        if not fused:
            raise FusionError(f"{name} checkpoints no module with parameters or buffers")

        holder = _Holder(driver)
        keys: dict[str, str] = {}  # checkpointed name -> submodule name in the holder
        for n in fused:
            key = n.replace(".", "_")  # "layers.0" (a list attribute's item)
            if key in holder._modules or hasattr(holder, key):
                key = f"_fused_{len(keys)}"
            holder.add_module(key, objects[n])
            keys[n] = key
        self._holder = holder

        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for n in fused:
            stacked_params, stacked_buffers = stack_module_state(
                [objs[n] for objs in member_objects]
            )
            params.update({f"{keys[n]}.{k}": v for k, v in stacked_params.items()})
            buffers.update({f"{keys[n]}.{k}": v for k, v in stacked_buffers.items()})
        self._params = params
        self._buffers = buffers

        # Each member's own tensors, by stacked name (where sync writes), and its
        # optimizer's parameters by stacked name (the fused optimizer's layout).
        self._targets: list[dict[str, torch.Tensor]] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        opt_names: list[str] | None = None
        rule: tuple[type[FusedOptimizer], dict[str, Any]] | None = None
        for objs in member_objects:
            targets: dict[str, torch.Tensor] = {}
            owner: dict[int, str] = {}  # id of a parameter -> its stacked name
            for n in fused:
                for k, t in objs[n].named_parameters():
                    if id(t) in owner:
                        raise FusionError(
                            f"{name}: parameter {n}.{k} is also {owner[id(t)]}; fusion "
                            "needs every parameter in one checkpointed module"
                        )
                    owner[id(t)] = targets_key = f"{keys[n]}.{k}"
                    targets[targets_key] = t
                targets.update({f"{keys[n]}.{k}": t for k, t in objs[n].named_buffers()})
            optimizers = [o for o in objs.values() if isinstance(o, torch.optim.Optimizer)]
            if len(optimizers) != 1:
                raise FusionError(
                    f"{name} checkpoints {len(optimizers)} optimizers; fusion needs exactly one"
                )
            optimizer = optimizers[0]
            member_rule = _fused_rule(optimizer, name)
            if rule is not None and member_rule != rule:
                raise FusionError(f"{name}: members' optimizers differ ({rule} and {member_rule})")
            rule = member_rule
            names = []
            for p in optimizer.param_groups[0]["params"]:
                if id(p) not in owner:
                    raise FusionError(
                        f"{name}: the optimizer updates a parameter of shape "
                        f"{tuple(p.shape)} that no checkpointed module holds"
                    )
                names.append(owner[id(p)])
            if opt_names is not None and names != opt_names:
                raise FusionError(f"{name}: members' optimizers hold different parameters")
            opt_names = names
            self._targets.append(targets)
            self._optimizers.append(optimizer)
        assert rule is not None and opt_names is not None
        self._rule, self._rule_args = rule
        self._opt_names = opt_names
        self._optimizer = self._new_optimizer()
        for b, optimizer in enumerate(self._optimizers):
            state = optimizer.state
            group = optimizer.param_groups[0]["params"]
            self._optimizer.load_member(
                b, {s: state[p] for s, p in zip(opt_names, group) if p in state}
            )
        # AMP: the driver's autocast settings; each member's own loss scale.
        self._amp = driver.amp
        self._scalers: list[torch.amp.GradScaler] = []
        self._scales: MemberScales | None = None
        try:
            scalers = [_the_scaler(m, objs) for m, objs in zip(self._members, member_objects)]
            if any(sc is not None for sc in scalers):
                self._scalers = [sc for sc in scalers if sc is not None]
                if len(self._scalers) != len(scalers):
                    raise ValueError("some members hold an enabled GradScaler, others not")
                device = next(iter(params.values())).device
                self._scales = MemberScales(self._scalers, device)
        except ValueError as exc:
            raise FusionError(f"{name}: {exc}") from exc

        # HFTA's form for the layers it covers (the driver's modules are the templates);
        # the first member's settings (instance attributes too).
        kernels = first.fused_kernels
        if kernels not in ("grouped", "vmap"):
            raise FusionError(f"{name}.fused_kernels must be 'grouped' or 'vmap', not {kernels!r}")
        self._grouped_layers = 0
        if kernels == "grouped":
            device = next(iter({**params, **buffers}.values())).device
            channels_last = first.fused_channels_last
            self._grouped_layers = install(
                [objects[n] for n in fused],
                Kernels(
                    dtype=None if self._amp is None else self._amp[1],
                    channels_last=(
                        device.type == "cuda" and self._amp is not None
                        if channels_last is None
                        else channels_last
                    ),
                ),
            )

        # Tied tensors (one parameter under two names) are stacked once, under their
        # first name; functional_call ties the others to it, at a cost per call worth
        # skipping when nothing is tied.
        tied = any(
            len(list(named(remove_duplicate=False))) != len(list(named()))
            for n in fused
            for named in (objects[n].named_parameters, objects[n].named_buffers)
        )

        def member_loss(
            p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], batch: Any
        ) -> torch.Tensor:
            return functional_call(holder, (p, b), (batch,), tie_weights=tied)

        # randomness="different": each member draws its own dropout masks.
        self._loss = vmap(member_loss, in_dims=(0, 0, None), randomness="different")

        self._steps = 0
        self._hp_stale = True  # re-read the members' optimizer values before a step
        self._synced: set[int] = set()  # members synced since the last step
        self._synced_model: set[int] = set()  # ... all but their optimizer state
        self._shared: list[dict[str, Any]] = [{} for _ in self._members]
        self._driver_shared: dict[str, Any] = {}

    def _new_optimizer(self) -> FusedOptimizer:
        return self._rule(
            {s: self._params[s] for s in self._opt_names},
            **self._rule_args,
        )

    # -- contract ---------------------------------------------------------------------------

    @property
    def members(self) -> Sequence[Trainer]:
        return tuple(self._members)

    def setup(self, i: int, hp: Mapping[str, Any]) -> None:
        """``members[i].setup(hp)``; names outside ``fusible`` also go to the driver
        (when its value changes): they are the same for every member."""
        self._members[i].setup(hp)
        self._hp_stale = True
        shared = {k: v for k, v in hp.items() if k not in self._fusible}
        if not shared:
            return
        self._shared[i].update(shared)
        changed = {
            k: v
            for k, v in shared.items()
            if k not in self._driver_shared or not _same(self._driver_shared[k], v)
        }
        if changed:
            self._driver.setup(changed)
            self._driver_shared.update(changed)

    def _refresh_hp(self) -> None:
        for j, values in enumerate(self._shared):
            for k, v in self._driver_shared.items():
                if k not in values or not _same(values[k], v):
                    raise ValueError(
                        f"fused members must share {k!r} (not fusible for {self._name}): "
                        f"member {j} has {values.get(k)!r}, another {v!r}"
                    )
        rows = [_group_hp(o.param_groups[0], self._rule) for o in self._optimizers]
        for k in rows[0]:
            self._optimizer.set_hp(k, [row[k] for row in rows])
        self._hp_stale = False

    def step(self) -> list[dict[str, float]]:
        """One ``train()`` of every member: ``updates_per_step`` fused updates.

        Raises:
            FusionError: on the first call, when the fused forward or backward fails
                (but ``torch.cuda.OutOfMemoryError``, raised as it is: the job is too
                wide for the device's memory, and narrower ones may fit).
        """
        if not self._members:
            return []
        if self._hp_stale:
            self._refresh_hp()
        driver = self._driver
        updates = _updates_per_step(driver)
        size = len(self._members)
        total: torch.Tensor | None = None
        with driver._rng_scope():  # the driver's streams: dropout, loader, transforms
            for _ in range(updates):
                for module in self._modules:
                    module.train()
                batch = driver.next_batch()
                try:
                    with autocast(self._amp, vmapped=True):
                        losses = self._loss(self._params, self._buffers, batch)
                    if not isinstance(losses, torch.Tensor) or losses.shape != (size,):
                        raise ValueError(
                            f"loss() must return a scalar tensor, got shape "
                            f"{tuple(getattr(losses, 'shape', ()))[1:]} per member"
                        )
                    scales = self._scales
                    (losses if scales is None else scales.scaled(losses)).sum().backward()
                except Exception as exc:
                    # Out of memory says the job is too wide for the device, not that
                    # the trainer cannot be fused: it goes up as it is.
                    if self._steps == 0 and not isinstance(exc, torch.cuda.OutOfMemoryError):
                        raise FusionError(
                            f"{self._name} cannot be fused: {type(exc).__name__}: {exc}"
                        ) from exc
                    raise
                self._amp_step()
                for p in self._params.values():
                    p.grad = None
                total = losses.detach() if total is None else total + losses.detach()
        self._steps += 1
        self._synced.clear()
        self._synced_model.clear()
        assert total is not None
        return [{"train_loss": value / updates} for value in total.tolist()]

    def _amp_step(self) -> None:
        """The fused optimizer's step; with loss scaling, unscaled per member, and a
        member whose gradients are not finite skips it (``GradScaler.step``/``update``)."""
        scales = self._scales
        if scales is None:
            self._optimizer.step()
            return
        optimizer = self._optimizer
        flat = optimizer.flat_grad()  # every gradient side by side: a step of a few ops
        if flat is not None:
            found = scales.unscale(flat)
        else:
            found = scales.unscale(
                [p.grad for p in optimizer.params.values() if p.grad is not None]
            )
        optimizer.step(skip=found, flat_grad=flat)
        scales.update(found)

    def sync(self, i: int, optimizer: bool = True) -> None:
        """Write member ``i``'s tensors, optimizer state (unless ``optimizer`` is False:
        enough to evaluate, and the costliest part) and the shared state (loader, RNG
        streams, extra state, modes) into its trainer."""
        if i in self._synced or (not optimizer and i in self._synced_model):
            return
        member = self._members[i]
        if optimizer:
            target_optimizer = self._optimizers[i]
            state = self._optimizer.member_state(i)
            target_optimizer.load_state_dict(
                {
                    "state": {j: state[s] for j, s in enumerate(self._opt_names) if s in state},
                    "param_groups": target_optimizer.state_dict()["param_groups"],
                }
            )
            self._synced.add(i)
        if i in self._synced_model:
            return
        self._synced_model.add(i)
        with torch.no_grad():
            for s, target in self._targets[i].items():
                source = self._params.get(s)
                target.copy_((self._buffers[s] if source is None else source)[i])
        driver = self._driver
        mine = member.checkpointed_objects()
        for n, obj in driver.checkpointed_objects().items():
            target = mine[n]
            if isinstance(obj, nn.Module):
                for sub, ours in zip(obj.modules(), target.modules()):
                    ours.training = sub.training
            elif isinstance(obj, torch.optim.Optimizer):
                continue
            elif isinstance(obj, torch.amp.GradScaler) and self._scales is not None:
                self._scales.write(i, target)  # each member's own loss scale
            elif is_rng_object(obj):
                set_rng_object_state(target, get_rng_object_state(obj))
            else:  # loaders, schedulers...: shared by every member
                target.load_state_dict(_clone_tree(obj.state_dict()))
        _set_global_rng(member, driver._current_rng())
        member.load_extra_state(_clone_tree(driver.extra_state()))

    def remove(self, i: int) -> Trainer:
        """Member ``i`` leaves (synced); the stacks keep the others, in order."""
        self.sync(i)
        member = self._members.pop(i)
        keep = [j for j in range(len(self._members) + 1) if j != i]
        states = [self._optimizer.member_state(j) for j in keep]
        self._targets.pop(i)
        self._optimizers.pop(i)
        self._shared.pop(i)
        if self._scales is not None:
            self._scalers.pop(i)
            self._scales.keep(keep)
        self._synced = {j - (j > i) for j in self._synced if j != i}
        self._synced_model = {j - (j > i) for j in self._synced_model if j != i}
        self._hp_stale = True
        if not self._members:  # nothing left to train: let the stacks go
            self._params, self._buffers = {}, {}
            return member
        with torch.no_grad():
            self._params = {
                s: p.detach()[keep].requires_grad_(p.requires_grad)  # indexing copies
                for s, p in self._params.items()
            }
            self._buffers = {s: b[keep] for s, b in self._buffers.items()}
        self._optimizer = self._new_optimizer()
        for b, state in enumerate(states):
            self._optimizer.load_member(b, state)
        return member
