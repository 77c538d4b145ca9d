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
        lead = f"{self.authors.split(',')[0].split(' and ')[0]} et al., " if self.authors else ""
        return f"{lead}{self.title} (arXiv {self.arxiv})"


def _arxiv(key: str, title: str, arxiv: str, year: int, authors: str = "") -> Paper:
    """A paper cited by its arXiv record (authors left out where we have not checked them)."""
    author_line = f"  author        = {{{authors}}},\n" if authors else ""
    bibtex = (
        f"@misc{{{key}{year},\n  title         = {{{title}}},\n{author_line}  year          = {{{year}}},\n"
        f"  eprint        = {{{arxiv}}},\n  archivePrefix = {{arXiv}}\n}}"
    )
    return Paper(key, title, authors, arxiv, year, bibtex)


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
        _arxiv(
            "sgrpo",
            "Mitigating Think-Answer Mismatch in LLM Reasoning Through Noise-Aware Advantage Reweighting",
            "2508.05928",
            2025,
            "Shen, Si and Shen, Peijun and Zhao, Wenhua and Zhu, Danhao",
        ),
        _arxiv(
            "delta_l",
            "Delta L Normalization: Rethink Loss Aggregation in RLVR",
            "2509.07558",
            2025,
            "He, Zhiyuan and Luo, Xufang and Zhang, Yike and Yang, Yuqing and Qiu, Lili",
        ),
        _arxiv(
            "drpo",
            "DRPO: Efficient Reasoning via Decoupled Reward Policy Optimization",
            "2510.04474",
            2025,
            "Li, Gang and Chen, Yan and Lin, Ming and Yang, Tianbao",
        ),
        _arxiv(
            "sr_grpo",
            "SR-GRPO: Stable Rank as an Intrinsic Geometric Reward for Large Language Model Alignment",
            "2512.02807",
            2025,
            "Tang, Yixuan and Yang, Yi",
        ),
        _arxiv(
            "dvao",
            "DVAO: Dynamic Variance-adaptive Advantage Optimization for Multi-reward Reinforcement Learning",
            "2605.25604",
            2026,
            "Jiang, Guochao and Song, Jingyi and Quan, Guofeng and Hao, Chuzhan and Liu, Guohua and Zhang, Yuewei",
        ),
        _arxiv(
            "dynamic_weighting",
            "Learning to Optimize Multi-Objective Alignment Through Dynamic Reward Weighting",
            "2509.11452",
            2025,
            "Lu, Yining and Wang, Zilong and Li, Shiyang and Liu, Xin and Yu, Changlong and Yin, Qingyu and Shi, "
            "Zhan and Zhang, Zixuan and Jiang, Meng",
        ),
        _arxiv(
            "ctwa",
            "Uncovering Cross-Objective Interference in Multi-Objective Alignment",
            "2602.06869",
            2026,
            "Lu, Yining and Jiang, Meng",
        ),
        _arxiv(
            "maxrl",
            "Maximum Likelihood Reinforcement Learning",
            "2602.02710",
            2026,
            "Tajwar, Fahim and Zeng, Guanning and Zhou, Yueer and Song, Yuda and Arora, Daman and Jiang, Yiding and "
            "Schneider, Jeff and Salakhutdinov, Ruslan and Feng, Haiwen and Zanette, Andrea",
        ),
        _arxiv(
            "oblr",
            "OBLR-PO: A Theoretical Framework for Stable Reinforcement Learning",
            "2511.23310",
            2025,
            "Huang, Zixun and Sheng, Jiayi and Zheng, Zeyu",
        ),
        _arxiv(
            "onpolicy_sft",
            "On-Policy Supervised Fine-Tuning for Efficient Reasoning",
            "2602.13407",
            2026,
            "Zhao, Anhao and Chen, Ziyang and Tong, Junlong and Fan, Yingqi and Ye, Fanghua and Li, Shuhao and Ma, "
            "Yunpu and Li, Wenjie and Shen, Xiaoyu",
        ),
        _arxiv(
            "constrained_rlhf",
            "Confronting Reward Model Overoptimization with Constrained RLHF",
            "2310.04373",
            2023,
            "Moskovitz, Ted and Singh, Aaditya K. and Strouse, DJ and Sandholm, Tuomas and Salakhutdinov, Ruslan and "
            "Dragan, Anca D. and McAleer, Stephen",
        ),
        _arxiv(
            "brme",
            "Reward-Robust RLHF in LLMs",
            "2409.15360",
            2024,
            "Yan, Yuzi and Lou, Xingzhou and Li, Jialian and Zhang, Yiping and Xie, Jian and Yu, Chao and Wang, Yu "
            "and Yan, Dong and Shen, Yuan",
        ),
        _arxiv(
            "map",
            "MAP: Revisiting Weight Decomposition for Low-Rank Adaptation",
            "2505.23094",
            2025,
            "Si, Chongjie and Shi, Zhiyi and Wang, Yadao and Yang, Xiaokang and Rahardja, Susanto and Shen, Wei",
        ),
        _arxiv(
            "rslora",
            "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA",
            "2312.03732",
            2023,
            "Kalajdzievski, Damjan",
        ),
        _arxiv(
            "tfb",
            "Training-Free Bayesianization for Low-Rank Adapters of Large Language Models",
            "2412.05723",
            2024,
            "Shi, Haizhou and Wang, Yibin and Han, Ligong and Zhang, Huan and Wang, Hao",
        ),
        _arxiv(
            "sine_lora",
            "Efficient Learning with Sine-Activated Low-Rank Matrices",
            "2403.19243",
            2024,
            "Ji, Yiping and Saratchandran, Hemanth and Gordon, Cameron and Zhang, Zeyu and Lucey, Simon",
        ),
        _arxiv(
            "stable_forgetting",
            "Stable Forgetting: Bounded Parameter-Efficient Unlearning in Foundation Models",
            "2509.24166",
            2025,
            "Garg, Arpit and Saratchandran, Hemanth and Garg, Ravi and Lucey, Simon",
        ),
        _arxiv(
            "ga_unlearning",
            "Knowledge Unlearning for Mitigating Privacy Risks in Language Models",
            "2210.01504",
            2022,
            "Jang, Joel and Yoon, Dongkeun and Yang, Sohee and Cha, Sungmin and Lee, Moontae and Logeswaran, "
            "Lajanugen and Seo, Minjoon",
        ),
        _arxiv(
            "npo",
            "Negative Preference Optimization: From Catastrophic Collapse to Effective Unlearning",
            "2404.05868",
            2024,
            "Zhang, Ruiqi and Lin, Licong and Bai, Yu and Mei, Song",
        ),
        _arxiv(
            "simnpo",
            "Simplicity Prevails: Rethinking Negative Preference Optimization for LLM Unlearning",
            "2410.07163",
            2024,
            "Fan, Chongyu and Liu, Jiancheng and Lin, Licong and Jia, Jinghan and Zhang, Ruiqi and Mei, Song and "
            "Liu, Sijia",
        ),
        _arxiv(
            "sga",
            "Label Smoothing Improves Gradient Ascent in LLM Unlearning",
            "2510.22376",
            2025,
            "Pang, Zirui and Zheng, Hao and Deng, Zhijie and Li, Ling and Zhong, Zixin and Wei, Jiaheng",
        ),
        _arxiv(
            "pdu",
            "Constrained Entropic Unlearning: A Primal-Dual Framework for Large Language Models",
            "2506.05314",
            2025,
            "Entesari, Taha and Hatami, Arman and Khaziev, Rinat and Ramakrishna, Anil and Fazlyab, Mahyar",
        ),
        _arxiv(
            "stableun",
            "Beyond Sharp Minima: Robust LLM Unlearning via Feedback-Guided Multi-Point Optimization",
            "2509.20230",
            2025,
            "Wu, Wenhan and Liu, Zheyuan and Gao, Chongyang and Wang, Ren and Ding, Kaize",
        ),
        _arxiv(
            "dmm",
            "Attribute-to-Delete: Machine Unlearning via Datamodel Matching",
            "2410.23232",
            2024,
            "Georgiev, Kristian and Rinberg, Roy and Park, Sung Min and Garg, Shivam and Ilyas, Andrew and Madry, "
            "Aleksander and Neel, Seth",
        ),
        _arxiv(
            "tofu",
            "TOFU: A Task of Fictitious Unlearning for LLMs",
            "2401.06121",
            2024,
            "Maini, Pratyush and Feng, Zhili and Schwarzschild, Avi and Lipton, Zachary C. and Kolter, J. Zico",
        ),
        # Model merging (hf_stable.merging; docs/merging.md).
        _arxiv(
            "model_soups",
            "Model soups: averaging weights of multiple fine-tuned models improves accuracy without increasing "
            "inference time",
            "2203.05482",
            2022,
            "Wortsman, Mitchell and Ilharco, Gabriel and Gadre, Samir Yitzhak and Roelofs, Rebecca and "
            "Gontijo-Lopes, Raphael and Morcos, Ari S. and Namkoong, Hongseok and Farhadi, Ali and Carmon, Yair and "
            "Kornblith, Simon and Schmidt, Ludwig",
        ),
        _arxiv(
            "task_arithmetic",
            "Editing Models with Task Arithmetic",
            "2212.04089",
            2022,
            "Ilharco, Gabriel and Ribeiro, Marco Tulio and Wortsman, Mitchell and Gururangan, Suchin and Schmidt, "
            "Ludwig and Hajishirzi, Hannaneh and Farhadi, Ali",
        ),
        _arxiv(
            "ties",
            "TIES-Merging: Resolving Interference When Merging Models",
            "2306.01708",
            2023,
            "Yadav, Prateek and Tam, Derek and Choshen, Leshem and Raffel, Colin and Bansal, Mohit",
        ),
        _arxiv(
            "dare",
            "Language Models are Super Mario: Absorbing Abilities from Homologous Models as a Free Lunch",
            "2311.03099",
            2023,
            "Yu, Le and Yu, Bowen and Yu, Haiyang and Huang, Fei and Li, Yongbin",
        ),
        _arxiv(
            "fisher_rao_merging",
            "Functionality-Oriented LLM Merging on the Fisher-Rao Manifold",
            "2603.04972",
            2026,
            "Wang, Jiayu and Ye, Zuojun and Yin, Wenpeng",
        ),
        _arxiv(
            "wsm",
            "WSM: Decay-Free Learning Rate Schedule via Checkpoint Merging for LLM Pre-training",
            "2507.17634",
            2025,
        ),
        _arxiv(
            "breadcrumbs",
            "Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks",
            "2312.06795",
            2023,
            "Davari, MohammadReza and Belilovsky, Eugene",
        ),
        _arxiv(
            "della",
            "DELLA-Merging: Reducing Interference in Model Merging through Magnitude-Based Sampling",
            "2406.11617",
            2024,
            "Deep, Pala Tej and Bhardwaj, Rishabh and Poria, Soujanya",
        ),
        _arxiv(
            "model_stock",
            "Model Stock: All we need is just a few fine-tuned models",
            "2403.19522",
            2024,
            "Jang, Dong-Hwan and Yun, Sangdoo and Han, Dongyoon",
        ),
        _arxiv(
            "fusechat_sce",
            "FuseChat: Knowledge Fusion of Chat Models",
            "2408.07990",
            2024,
            "Wan, Fanqi and Zhong, Longguang and Yang, Ziyi and Chen, Ruijun and Quan, Xiaojun",
        ),
        _arxiv(
            "ram_merging",
            "Behavior Knowledge Merge in Reinforced Agentic Models",
            "2601.13572",
            2026,
            "Yuan, Xiangchi and Shi, Dachuan and Zhang, Chunhui and Liu, Zheyuan and Yao, Shenglong and Vosoughi, "
            "Soroush and Lee, Wenke",
        ),
        _arxiv(
            "fw_merging",
            "FW-Merging: Scaling Model Merging with Frank-Wolfe Optimization",
            "2503.12649",
            2025,
            "Chen, Hao Mark and others",
        ),
        _arxiv(
            "p3o",
            "P3O: Policy-on Policy-off Policy Optimization",
            "1905.01756",
            2019,
            "Fakoor, Rasool and Chaudhari, Pratik and Smola, Alexander J.",
        ),
        _arxiv(
            "palm",
            "PaLM: Scaling Language Modeling with Pathways",
            "2204.02311",
            2022,
            "Chowdhery, Aakanksha and others",
        ),
        _arxiv(
            "component_clip",
            "Improving Stability of Fine-Tuning Pretrained Language Models via Component-Wise Gradient Norm Clipping",
            "2210.10325",
            2022,
            "Yang, Chenghao and Ma, Xuezhe",
        ),
        _arxiv(
            "adagc", "AdaGC: Improving Training Stability for Large Language Model Pretraining", "2502.11034", 2025
        ),
        _arxiv(
            "msign",
            "MSign: An Optimizer Preventing Training Instability in Large Language Models via Stable Rank Restoration",
            "2602.01734",
            2026,
            "Ren, Lianhai and Ding, Yucheng and Liu, Xiao and Li, Qianxiao and Cheng, Peng and Gong, Yeyun",
        ),
        _arxiv(
            "reg",
            "REG: A Regularization Optimizer for Robust Training Dynamics",
            "2510.03691",
            2025,
            "Liu, Zehua and Wu, Han and Fu, Xiaojin and Liu, Shuqi and Han, Xiongwei and Zhong, Tao and "
            "Yuan, Mingxuan",
        ),
    )
}

# Seed methods recorded after the first release (ids checked against the arXiv abstract pages): the innovation
# probe and the drift monitor (reconstructions from their abstracts), and the label-free majority vote.
PAPERS.update(
    {
        p.key: p
        for p in (
            _arxiv(
                "innovation_probe",
                "Automatic Stability and Recovery for Neural Network Training",
                "2601.17483",
                2026,
                "Or, Barak",
            ),
            _arxiv(
                "geometric_canary",
                "The Geometric Canary: Predicting Steerability and Detecting Drift via Representational Stability",
                "2604.17698",
                2026,
                "Raju, Prashant C.",
            ),
            _arxiv(
                "ttrl",
                "TTRL: Test-Time Reinforcement Learning",
                "2504.16084",
                2025,
                "Zuo, Yuxin and Zhang, Kaiyan and Sheng, Li and Qu, Shang and Cui, Ganqu and Zhu, Xuekai and Li, "
                "Haozhan and Zhang, Yuchen and Long, Xinwei and Hua, Ermo and Qi, Biqing and Sun, Youbang and Ma, "
                "Zhiyuan and Yuan, Lifan and Ding, Ning and Zhou, Bowen",
            ),
            _arxiv(
                "stable_spam",
                "Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit Adam",
                "2502.17055",
                2025,
                "Huang, Tianjin and others",
            ),
            _arxiv(
                "certified_self_consistency",
                "Certified Self-Consistency: Statistical Guarantees and Test-Time Training for Reliable Reasoning in "
                "LLMs",
                "2510.17472",
                2025,
                "Cordero-Encinar, Paula and Duncan, Andrew B.",
            ),
        )
    }
)

# StableReinforce (the seed-methods issue): the R1-Reward paper, authors from its arXiv record.
PAPERS["r1_reward"] = _arxiv(
    "r1_reward",
    "R1-Reward: Training Multimodal Reward Model Through Stable Reinforcement Learning",
    "2505.02835",
    2025,
    "Zhang, Yi-Fan and Lu, Xingyu and Hu, Xiao and Fu, Chaoyou and Wen, Bin and Zhang, Tianke and Liu, Changyi and "
    "Jiang, Kaiyu and Chen, Kaibing and Tang, Kaiyu and Ding, Haojie and Chen, Jiankang and Yang, Fan and Zhang, "
    "Zhang and Gao, Tingting and Wang, Liang",
)

# Singular-value fine-tuning (the seed-methods issue): the seed abstract is that of v1 ("CLOVER: Constrained Learning
# with Orthonormal Vectors for Eliminating Redundancy"); the title below is the arXiv record's current one.
PAPERS["clover"] = _arxiv(
    "clover",
    "CLOVER: Cross-Layer Orthogonal Vectors Pruning and Fine-Tuning",
    "2411.17426",
    2024,
    "Meng, Fanxu and Tang, Pingzhi and Jiang, Fan and Zhang, Muhan",
)

# GDPO composition and length-conditional reward masking (the seed-methods issue): GDPO is the normalisation TRL's
# `multi_objective_aggregation="normalize_then_sum"` implements; BalCapRL applies it to continuous captioning rewards
# and adds the length-conditional mask. Authors from their arXiv records.
PAPERS["gdpo"] = _arxiv(
    "gdpo",
    "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization",
    "2601.05242",
    2026,
    "Liu, Shih-Yang and Dong, Xin and Lu, Ximing and Diao, Shizhe and Belcak, Peter and Liu, Mingjie and Chen, "
    "Min-Hung and Yin, Hongxu and Wang, Yu-Chiang Frank and Cheng, Kwang-Ting and Choi, Yejin and Kautz, Jan and "
    "Molchanov, Pavlo",
)
PAPERS["balcaprl"] = _arxiv(
    "balcaprl",
    "BalCapRL: A Balanced Framework for RL-Based MLLM Image Captioning",
    "2605.07394",
    2026,
    "Ye, Shaokai and Saveris, Vasileios and Qian, Yihao and Hu, Jiaming and Amirloo, Elmira and Grasch, Peter",
)
