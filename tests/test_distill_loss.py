"""DistillSparse v2's loss (`sparserl.algo.distill`), hand-checked: TV is 1 - alpha, forward KL is KL(teacher ||
student) and zero (with zero gradient) at the teacher, tail weights by each mode, and bad names are named."""

from __future__ import annotations

import pytest
import torch

from sparserl.algo import acceptance_exact
from sparserl.algo.distill import distill_loss, tail_weights, token_divergence


def logps(seed: int, shape=(2, 3, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).log_softmax(-1)


def test_tv_is_one_minus_alpha_and_forward_kl_is_the_teacher_weighted_kl():
    student, teacher = logps(0), logps(1)
    tv = token_divergence(student, teacher, "tv")
    torch.testing.assert_close(tv, 1 - acceptance_exact(student, teacher), atol=1e-6, rtol=0)
    kl = token_divergence(student, teacher, "forward_kl")
    torch.testing.assert_close(kl, (teacher.exp() * (teacher - student)).sum(-1))
    logits = teacher.clone().requires_grad_(True)  # the student's logits at the teacher's distribution
    token_divergence(logits.log_softmax(-1), teacher, "forward_kl").sum().backward()
    assert float(token_divergence(teacher, teacher, "forward_kl").abs().max()) < 1e-6
    assert float(logits.grad.abs().max()) < 1e-6  # the KL's minimum: no pull at the teacher


def test_a_cut_teacher_id_costs_zero_and_a_cut_student_id_a_finite_penalty():
    teacher = torch.tensor([[0.0, float("-inf")]])  # the teacher's top-k cut the second id
    student = torch.tensor([[float("-inf"), 0.0]])  # the student's the first
    assert float(token_divergence(teacher, teacher, "forward_kl")) == 0.0
    assert torch.isfinite(token_divergence(student, teacher, "forward_kl")).all()


def test_tail_weights_by_mode():
    alpha = torch.tensor([[0.9, 0.5, 1.0, 0.7]])
    positions = torch.tensor([[0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert tail_weights(alpha, positions, mask, "none").tolist() == [[1.0, 1.0, 1.0, 0.0]]
    w = tail_weights(alpha, positions, mask, "tv")  # 1 - alpha = 0.1, 0.5, 0: mean 0.2 over the valid three
    torch.testing.assert_close(w, torch.tensor([[0.5, 2.5, 0.0, 0.0]]))
    lowest = tail_weights(alpha, positions, mask, "lowest", fraction=0.5, bin_width=2)
    assert lowest.tolist() == [[0.0, 2.0, 2.0, 0.0]]  # per bin of 2 positions: the lower half (ties kept)
    with pytest.raises(ValueError, match="tail weighting 'top' is unknown"):
        tail_weights(alpha, positions, mask, "top")
    with pytest.raises(ValueError, match="divergence 'js' is unknown"):
        token_divergence(logps(0), logps(1), "js")


def test_loss_sums_weighted_divergences_over_valid_tokens():
    student, teacher = logps(2), logps(3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    positions = torch.arange(3).expand(2, 3)
    loss, m = distill_loss(student, teacher, positions, mask, "tv", "none")
    tv = token_divergence(student, teacher, "tv")
    torch.testing.assert_close(loss, (tv * mask).sum())
    assert m["distill/tv"] == pytest.approx(float(tv[mask.bool()].mean()))
    assert m["distill/loss"] == pytest.approx(float(loss) / 3)
