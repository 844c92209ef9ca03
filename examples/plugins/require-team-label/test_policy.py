"""Unit tests of the rule: `python3 -m unittest` in this directory (no packages needed)."""

import unittest

from policy import Config, denial, parse_configuration


def obj(labels=None, name="web", kind="ConfigMap"):
    metadata = {"name": name}
    if labels is not None:
        metadata["labels"] = labels
    return {"apiVersion": "v1", "kind": kind, "metadata": metadata}


class RequireTeamLabel(unittest.TestCase):
    def test_allows_a_labelled_object(self):
        self.assertIsNone(denial(obj({"team": "payments"}), Config()))

    def test_denies_a_missing_or_empty_label_with_a_clear_message(self):
        for labels in (None, {}, {"app": "web"}, {"team": ""}):
            message = denial(obj(labels), Config())
            self.assertEqual(
                message,
                'ConfigMap "web" has no "team" label; every object must name the team '
                "that owns it (add metadata.labels.team: payments)",
            )

    def test_names_generated_objects_by_their_prefix(self):
        o = {"kind": "Pod", "metadata": {"generateName": "job-"}}
        self.assertTrue(denial(o, Config()).startswith('Pod "job-*" has no "team" label'))

    def test_known_teams_and_another_label(self):
        config = parse_configuration('{"label": "example.com/owner", "teams": ["storage", "web"]}')
        self.assertIsNone(denial(obj({"example.com/owner": "web"}), config))
        self.assertIn(
            "which is not a known team (known: storage, web)",
            denial(obj({"example.com/owner": "nobody"}), config),
        )
        self.assertIn("add metadata.labels.example.com/owner: storage", denial(obj(), config))

    def test_rejects_bad_configuration(self):
        self.assertEqual(parse_configuration(""), Config())
        for text, words in (
            ("[]", "must be a JSON object"),
            ("{", "not JSON"),
            ('{"lable": "x"}', "unknown field 'lable'"),
            ('{"label": ""}', "non-empty string"),
            ('{"teams": "web"}', "list of team names"),
        ):
            with self.assertRaises(ValueError) as caught:
                parse_configuration(text)
            self.assertIn(words, str(caught.exception))


if __name__ == "__main__":
    unittest.main()
