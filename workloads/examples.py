"""A few task-shaped prompts per task, written here in the style of each benchmark.

They are the default prompt text of generated workloads, and the corpus the embedded models'
tokenizer is trained on. Real task data can replace them where lm-eval's datasets are at hand.
"""

from __future__ import annotations

EXAMPLES: dict[str, tuple[str, ...]] = {
    "hellaswag": (
        "A man is standing on a ladder next to a house. He scrapes old paint off the window frame "
        "with a flat tool. Then he\nA) dips a brush in white paint and coats the frame.\n"
        "B) climbs down and drives the ladder to the beach.\nC) eats the paint scraper.\n"
        "D) opens an umbrella inside the kitchen.\nWhich ending is most likely?",
        "A girl sits at a piano in a small room and places her hands on the keys. She\n"
        "A) begins to play a slow song while reading the sheet music.\n"
        "B) pours the piano into a glass.\nC) folds the piano into a paper plane.\n"
        "D) runs a marathon across the keyboard.\nWhich ending is most likely?",
        "Two people are kneading dough on a floured counter. One of them shapes the dough into a "
        "ball. Next they\nA) place it in a bowl and cover it with a towel to rise.\n"
        "B) throw it into the washing machine.\nC) paint it blue and hang it on the wall.\n"
        "D) plant it in the garden.\nWhich ending is most likely?",
        "A woman ties her running shoes and stretches her legs at the edge of a park. She\n"
        "A) starts jogging along the path around the lake.\nB) swims up the stairs.\n"
        "C) stretches the shoes over her head.\nD) sells the park to a neighbour.\n"
        "Which ending is most likely?",
        "A mechanic rolls under a car on a creeper and loosens a bolt with a wrench. Oil starts "
        "to drain into a pan. He\nA) waits for the oil to finish draining, then replaces the "
        "plug.\nB) drinks the oil.\nC) drives the car while still underneath it.\n"
        "D) turns the pan into a hat.\nWhich ending is most likely?",
    ),
    "copa": (
        "Premise: The pond froze over during the night.\nWhat was the cause?\n"
        "1) The temperature dropped below freezing.\n2) The sun was very hot.\nAnswer:",
        "Premise: I left the bread on the counter for a week.\nWhat happened as a result?\n"
        "1) The bread grew mould.\n2) The bread turned into butter.\nAnswer:",
        "Premise: The crowd cheered loudly.\nWhat was the cause?\n"
        "1) The home team scored a goal.\n2) The stadium lights were switched off.\nAnswer:",
        "Premise: She put on her sunglasses.\nWhat was the cause?\n"
        "1) The sun was glaring.\n2) It was raining at midnight.\nAnswer:",
        "Premise: The battery in my phone ran out.\nWhat happened as a result?\n"
        "1) The screen went dark.\n2) The phone became heavier.\nAnswer:",
    ),
    "piqa": (
        "Goal: Keep a cut avocado from turning brown.\nSolution 1: Squeeze lemon juice on the "
        "cut surface and wrap it tightly.\nSolution 2: Leave it open in the sun for an "
        "afternoon.\nWhich solution is better?",
        "Goal: Loosen a jar lid that is stuck.\nSolution 1: Run the lid under hot water for a "
        "minute, then twist.\nSolution 2: Put the jar in the freezer upside down for a week.\n"
        "Which solution is better?",
        "Goal: Dry wet shoes overnight.\nSolution 1: Stuff them with newspaper and leave them "
        "somewhere warm.\nSolution 2: Fill them with water and close them in a bag.\n"
        "Which solution is better?",
        "Goal: Find a small screw that fell on a carpet.\nSolution 1: Sweep a magnet slowly "
        "across the carpet.\nSolution 2: Pour glue over the carpet and wait.\n"
        "Which solution is better?",
        "Goal: Make a cup of tea stronger.\nSolution 1: Let the tea bag steep for a few more "
        "minutes.\nSolution 2: Add ice cubes before the water boils.\nWhich solution is better?",
    ),
    "openbookqa": (
        "Question: Which of these would let the most heat travel through it?\n"
        "A) a wooden spoon B) a steel pan C) a wool sock D) a plastic cup\nAnswer:",
        "Question: A plant that is kept in a dark closet for weeks will most likely\n"
        "A) grow faster B) turn pale and weak C) produce more fruit D) become a rock\nAnswer:",
        "Question: The moon shines at night because it\n"
        "A) makes its own light B) reflects light from the sun C) is on fire "
        "D) absorbs starlight\nAnswer:",
        "Question: Which is an example of a renewable resource?\n"
        "A) coal B) natural gas C) wind D) oil\nAnswer:",
        "Question: An animal that hunts other animals for food is called a\n"
        "A) producer B) predator C) decomposer D) herbivore\nAnswer:",
    ),
}


def corpus() -> str:
    """All examples as one text, in a fixed order."""
    return "\n\n".join(text for task in sorted(EXAMPLES) for text in EXAMPLES[task])
