"""Per-token reverse KL from the student to a teacher, over the full vocabulary.

    KL(p_s ‖ p_t) = Σ_v p_s(v) · (log p_s(v) − log p_t(v))

with p_s = softmax(student logits), p_t = softmax(teacher logits) at the same position. Reverse (student
first) is mode-seeking: the student is penalised for putting mass where the teacher has little, and
the expectation is over the student's own distribution, which is what on-policy samples estimate. Its
gradient with respect to the student's logit z_j is

    ∂KL/∂z_j = p_s(j) · (log p_s(j) − log p_t(j) − KL)

(the teacher is a constant). Computed in fp32 (fp64 for fp64 inputs) whatever the logits' dtype.
"""

import torch
import torch.nn.functional as F


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """student_logits, teacher_logits (N, V) -> KL(p_s ‖ p_t) per position (N,); the teacher is detached."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {list(student_logits.shape)} and teacher logits "
            f"{list(teacher_logits.shape)} differ in shape (they need the same positions and "
            f"vocabulary)"
        )
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    log_s = F.log_softmax(student_logits.to(dtype), dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(dim=-1)
