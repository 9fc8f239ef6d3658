"""Model definitions (reading K/V from the paged cache) and weight loading."""
