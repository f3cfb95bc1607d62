"""Twenty varied prompts for the reference comparisons (chat, plain text, code, numbers, other languages)."""

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "What are the main differences between Python and C?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a list in Python?",
    "What is 17 multiplied by 23?",
    "Tell me a short story about a robot who learns to paint.",
]
PLAIN = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "1, 1, 2, 3, 5, 8, 13,",
    "La tour Eiffel est",
    "The three laws of thermodynamics are",
    "SELECT name, COUNT(*) FROM orders",
    "In 1969, astronauts",
]


def prompt_ids(tokenizer) -> list[list[int]]:
    chat = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
        for c in CHAT
    ]
    return chat + [tokenizer.encode(p) for p in PLAIN]
