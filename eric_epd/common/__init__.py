"""Small pieces shared by several processes of Eric."""
