"""A chat-length distribution shaped like ShareGPT's, shipped as a table so that nothing is downloaded.

These are NOT measured from the ShareGPT data set. They are the quantiles (0, 5, …, 100 %) of log-normal laws fitted
to its published means in the token counts `vllm bench serve` uses (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", 2023, Fig. 11a: mean input 161, mean output 338 tokens), with
vLLM's filter (input 4..1024 tokens, input + output <= 2048): input median 94, σ 1.25 → mean 158; output median
262, σ 0.8 → mean 336. Heavy right tails, like the real conversations; use them to size, not to reproduce a
published ShareGPT figure.
"""

INPUT_QUANTILES = (4, 13, 19, 26, 33, 40, 48, 57, 67, 78, 91, 106, 123, 144, 170, 203, 246, 305, 396, 561, 1024)
OUTPUT_QUANTILES = (5, 70, 93, 114, 133, 151, 171, 190, 211, 234, 258, 285, 315, 349, 390, 438, 498, 577, 692, 891,
                    1536)
