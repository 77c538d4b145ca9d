"""The papers hf_stable implements: one record each, used by the registries, model cards and the docs' paper index."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paper:
    key: str
    title: str
    authors: str
    arxiv: str
    year: int
    bibtex: str

    @property
    def url(self) -> str:
        return f"https://arxiv.org/abs/{self.arxiv}"

    @property
    def short(self) -> str:
        return f"{self.authors.split(',')[0].split(' and ')[0]} et al., {self.title} (arXiv {self.arxiv})"


PAPERS = {
    p.key: p
    for p in (
        Paper(
            "beyond_ll",
            "Beyond Log Likelihood: Probability-Based Objectives for Supervised Fine-Tuning across the Model "
            "Capability Continuum",
            "Li, Gaotang and Qiu, Ruizhong and Chen, Xiusi and Ji, Heng and Tong, Hanghang",
            "2510.00526",
            2025,
            "@article{li2025beyond,\n"
            "  title   = {Beyond Log Likelihood: Probability-Based Objectives for Supervised Fine-Tuning across the "
            "Model Capability Continuum},\n"
            "  author  = {Li, Gaotang and Qiu, Ruizhong and Chen, Xiusi and Ji, Heng and Tong, Hanghang},\n"
            "  journal = {arXiv preprint arXiv:2510.00526},\n"
            "  year    = {2025}\n}",
        ),
        Paper(
            "redi",
            "Harnessing Negative Signals: Reinforcement Distillation from Teacher Data for LLM Reasoning",
            "Xu, Shuyao and Peng, Cheng and Long, Jiangxuan and Xu, Weidi and Chu, Wei and Qi, Yuan",
            "2505.24850",
            2025,
            "@inproceedings{xu2026harnessing,\n"
            "  title     = {Harnessing Negative Signals: Reinforcement Distillation from Teacher Data for {LLM} "
            "Reasoning},\n"
            "  author    = {Xu, Shuyao and Peng, Cheng and Long, Jiangxuan and Xu, Weidi and Chu, Wei and Qi, Yuan},\n"
            "  booktitle = {Proceedings of the 64th Annual Meeting of the Association for Computational "
            "Linguistics},\n"
            "  year      = {2026}\n}",
        ),
        Paper(
            "feasible_learning",
            "Feasible Learning",
            "Ramirez, Juan and Hounie, Ignacio and Elenter, Juan and Gallego-Posada, Jose and Hashemizadeh, Meraj and "
            "Ribeiro, Alejandro and Lacoste-Julien, Simon",
            "2501.14912",
            2025,
            "@inproceedings{ramirez2025feasible,\n"
            "  title     = {Feasible Learning},\n"
            "  author    = {Ramirez, Juan and Hounie, Ignacio and Elenter, Juan and Gallego-Posada, Jose and "
            "Hashemizadeh, Meraj and Ribeiro, Alejandro and Lacoste-Julien, Simon},\n"
            "  booktitle = {International Conference on Artificial Intelligence and Statistics (AISTATS)},\n"
            "  year      = {2025}\n}",
        ),
        Paper(
            "dft",
            "On the Generalization of SFT: A Reinforcement Learning Perspective with Reward Rectification",
            "Wu, Yongliang and others",
            "2508.05629",
            2025,
            "@article{wu2025generalization,\n"
            "  title   = {On the Generalization of SFT: A Reinforcement Learning Perspective with Reward "
            "Rectification},\n"
            "  author  = {Wu, Yongliang and others},\n"
            "  journal = {arXiv preprint arXiv:2508.05629},\n"
            "  year    = {2025}\n}",
        ),
    )
}
