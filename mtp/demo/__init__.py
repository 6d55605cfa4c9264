"""`mtp demo`: a page on which greedy and a self-speculative decoder race on one prompt, every
token coloured by its origin (head 1's own, a draft of head 2 / 3 / 4, a lookup draft).

`race` runs the racers in turns with honest clocks, hearing each round through the decode loop's
streaming hook (`generate(..., on_tokens=...)`); `render` draws the lanes, the legend, the
verdict and the acceptance chart as HTML; `page` is the Gradio page and its API (`/race`);
`cli` the command. Gradio is the optional extra `demo`; nothing here is imported by `mtp
--help`.
"""
