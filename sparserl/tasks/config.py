"""TaskConfig: which prompts the trainer samples and how their completions are rewarded."""

from __future__ import annotations

from dataclasses import dataclass, field

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BUILTIN_TASKS = ("arithmetic", "long_arithmetic", "gsm8k", "math")


@dataclass
class TaskConfig:
    """Task selection, data source and field mapping, procedural difficulty and reward options."""

    name: str = field(
        default="arithmetic",
        metadata={
            "help": "Task: 'arithmetic', 'long_arithmetic' (procedural, no files), 'gsm8k', 'math', or a "
            "local .jsonl/.json/.parquet path or a Hugging Face dataset name (then read like `data`); with `data` set, "
            "any other name just labels that dataset."
        },
    )
    data: str = field(
        default="",
        metadata={
            "help": "Data source of gsm8k/math/dataset tasks: a local .jsonl/.json/.parquet file or a Hugging "
            "Face dataset name. '{split}' in a path is replaced by the split. Empty: the task's default "
            "(gsm8k: openai/gsm8k; math: DigitalLearningGmbH/MATH-lighteval)."
        },
    )
    data_config: str = field(
        default="",
        metadata={
            "help": "Hugging Face dataset configuration name (e.g. 'main' for openai/gsm8k); empty: default."
        },
    )
    split: str = field(
        default="",
        metadata={
            "help": "Split to read; empty: the split the caller asks for ('train' for training, 'test' for "
            "eval). Procedural tasks draw a different stream of problems per split."
        },
    )
    question_key: str = field(
        default="",
        metadata={
            "help": "Row field holding the question (a string or a list of chat messages); dotted for nested "
            "fields ('extra.q'). Empty: auto-detect problem/question/prompt/query/input/instruction."
        },
    )
    answer_key: str = field(
        default="",
        metadata={
            "help": "Row field holding the reference answer; dotted for nested fields "
            "('reward_model.ground_truth'). Empty: auto-detect final_answer/answer/label/ground_truth/gt/"
            "target/solution. '#### N' and \\boxed{} in it are reduced to the final answer."
        },
    )
    max_examples: int = field(default=0, metadata={"help": "Datasets: keep only the first N rows (0 = all)."})
    num_examples: int = field(
        default=10000, metadata={"help": "Procedural tasks: number of distinct problems per split."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the procedural problem generators."})
    num_operands: int = field(default=2, metadata={"help": "arithmetic: operands per expression (>= 2)."})
    min_digits: int = field(
        default=1, metadata={"help": "arithmetic/long_arithmetic: fewest digits of an operand."}
    )
    max_digits: int = field(
        default=2, metadata={"help": "arithmetic/long_arithmetic: most digits of an operand."}
    )
    operators: str = field(
        default="+",
        metadata={"help": "arithmetic/long_arithmetic: operators to draw from, any of '+-*' (e.g. '+-')."},
    )
    num_facts: int = field(
        default=3,
        metadata={
            "help": "long_arithmetic: named values defined at the very start of the prompt (the question "
            "combines num_query of them)."
        },
    )
    num_query: int = field(
        default=2,
        metadata={"help": "long_arithmetic: early values the final question combines (<= num_facts)."},
    )
    num_distractors: int = field(
        default=40,
        metadata={
            "help": "long_arithmetic: filler lines (other named values and their updates) between the early "
            "facts and the question; sets the distance the answer must be recalled across (~12 tokens each)."
        },
    )
    format_weight: float = field(
        default=0.0,
        metadata={
            "help": "Weight w of the format reward: reward = (1 - w) * correct + w * [well-formed \\boxed{} "
            "present]; 0 = correctness only."
        },
    )
    reward_timeout: float = field(
        default=5.0,
        metadata={
            "help": "Seconds one reward call may take (math-verify runs in a killable worker process); a "
            "timeout or error scores 0 and is counted in the reward stats."
        },
    )
    system_prompt: str = field(
        default="",
        metadata={
            "help": "System message put first in every prompt (replacing one from the data); empty: none "
            "added (the chat template may add its own)."
        },
    )
    instruction: str = field(
        default=BOXED_INSTRUCTION,
        metadata={
            "help": "Instruction appended to the question (on its own line) unless it already asks for \\boxed{}."
        },
    )

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError(f"task.name is empty; choose one of {', '.join(BUILTIN_TASKS)} or a data path")
        bad_ops = set(self.operators) - set("+-*")
        if not self.operators or bad_ops:
            raise ValueError(f"task.operators={self.operators!r} must be a non-empty string of '+', '-', '*'")
        if self.num_operands < 2:
            raise ValueError(f"task.num_operands={self.num_operands} must be >= 2")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"task.min_digits={self.min_digits} and task.max_digits={self.max_digits} need "
                "1 <= min_digits <= max_digits"
            )
        if self.max_digits > 18:
            raise ValueError(f"task.max_digits={self.max_digits} must be <= 18")
        if not 1 <= self.num_query <= self.num_facts:
            raise ValueError(
                f"task.num_query={self.num_query} must be between 1 and task.num_facts={self.num_facts}"
            )
        if self.num_facts > 26 or self.num_distractors < 0 or self.num_distractors > 10000:
            raise ValueError(
                f"task.num_facts={self.num_facts} must be <= 26 and task.num_distractors="
                f"{self.num_distractors} between 0 and 10000"
            )
        if self.num_examples < 1 or self.max_examples < 0:
            raise ValueError(
                f"task.num_examples={self.num_examples} must be >= 1 and task.max_examples="
                f"{self.max_examples} >= 0"
            )
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"task.format_weight={self.format_weight} must be in [0, 1]")
        if not self.reward_timeout > 0:
            raise ValueError(f"task.reward_timeout={self.reward_timeout} must be > 0 seconds")
