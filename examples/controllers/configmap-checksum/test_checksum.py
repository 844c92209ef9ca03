"""Native tests of the rule (python3 -m unittest, from this directory)."""

import unittest

import checksum


def configmap(data, labels=None, annotations=None):
    return {"metadata": {"name": "c", "labels": labels or {}, "annotations": annotations or {}},
            "data": data}


class Checksum(unittest.TestCase):
    config = {"label": checksum.DEFAULT_LABEL}

    def test_a_selected_configmap_gets_the_sha256_of_its_data(self):
        cm = configmap({"b": "2", "a": "1"}, labels={"trellis.dev/checksum": "true"})
        patch = checksum.wanted_patch(cm, self.config)
        digest = patch["metadata"]["annotations"][checksum.ANNOTATION]
        self.assertEqual(len(digest), 64)
        # The same data in another order: the same digest.
        self.assertEqual(digest, checksum.checksum(configmap({"a": "1", "b": "2"})))

    def test_an_up_to_date_annotation_needs_nothing(self):
        cm = configmap({"a": "1"}, labels={"trellis.dev/checksum": "true"})
        cm["metadata"]["annotations"][checksum.ANNOTATION] = checksum.checksum(cm)
        self.assertIsNone(checksum.wanted_patch(cm, self.config))

    def test_an_unselected_configmap_loses_the_annotation(self):
        cm = configmap({"a": "1"}, annotations={checksum.ANNOTATION: "old"})
        self.assertEqual(checksum.wanted_patch(cm, self.config),
                         {"metadata": {"annotations": {checksum.ANNOTATION: None}}})
        self.assertIsNone(checksum.wanted_patch(configmap({"a": "1"}), self.config))

    def test_configuration_is_checked(self):
        self.assertEqual(checksum.parse_configuration('{"label": "x"}'), {"label": "x"})
        with self.assertRaises(ValueError):
            checksum.parse_configuration('{"lable": "x"}')
        with self.assertRaises(ValueError):
            checksum.parse_configuration('{"label": ""}')


if __name__ == "__main__":
    unittest.main()
