"""Host memory as the overflow: `toma.map` over host rows, `HostedEmbedding` tables with their optimizer state
on the host, and the page-locked host tensors they copy from."""
