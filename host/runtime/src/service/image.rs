//! The CRI `ImageService` on [`Runtime`]: what its image store holds, pulls and
//! removes.

use std::collections::HashMap;

use k8s_cri::v1::image_service_server::ImageService;
use k8s_cri::v1::*;
use tonic::{Request, Response};

use super::Reply;
use crate::Runtime;
use crate::record::ImageRecord;

#[tonic::async_trait]
impl ImageService for Runtime {
    async fn list_images(&self, request: Request<ListImagesRequest>) -> Reply<ListImagesResponse> {
        let name = request
            .into_inner()
            .filter
            .and_then(|f| f.image)
            .map(|i| i.image)
            .unwrap_or_default();
        // An image named is looked up (a hollow node's are never listed, all present).
        let images = match name.as_str() {
            "" => self.images.list().iter().map(to_image).collect(),
            name => self.images.get(name).iter().map(to_image).collect(),
        };
        Ok(Response::new(ListImagesResponse { images }))
    }

    async fn image_status(
        &self,
        request: Request<ImageStatusRequest>,
    ) -> Reply<ImageStatusResponse> {
        let name = request
            .into_inner()
            .image
            .map(|i| i.image)
            .unwrap_or_default();
        Ok(Response::new(ImageStatusResponse {
            image: self.images.get(&name).as_ref().map(to_image),
            info: HashMap::new(),
        }))
    }

    async fn pull_image(&self, request: Request<PullImageRequest>) -> Reply<PullImageResponse> {
        let request = request.into_inner();
        let reference = request.image.map(|i| i.image).unwrap_or_default();
        let image_ref = self.images.clone().pull(reference, request.auth).await?;
        Ok(Response::new(PullImageResponse { image_ref }))
    }

    async fn remove_image(
        &self,
        request: Request<RemoveImageRequest>,
    ) -> Reply<RemoveImageResponse> {
        let name = request
            .into_inner()
            .image
            .map(|i| i.image)
            .unwrap_or_default();
        self.images.remove(&name)?;
        Ok(Response::new(RemoveImageResponse {}))
    }

    async fn image_fs_info(&self, _: Request<ImageFsInfoRequest>) -> Reply<ImageFsInfoResponse> {
        Ok(Response::new(ImageFsInfoResponse {
            image_filesystems: self.images.filesystems(),
            container_filesystems: Vec::new(),
        }))
    }
}

fn to_image(image: &ImageRecord) -> Image {
    Image {
        id: image.id.clone(),
        repo_tags: image.tags.clone(),
        repo_digests: image.digests.clone(),
        size: image.size,
        // A program on the node has no image to name a user: its container runs as
        // nobody unless the pod names one (`sandbox`), which a `runAsNonRoot` check
        // can tell.
        uid: (image.kind == crate::record::ImageKind::Process).then_some(Int64Value {
            value: i64::from(crate::sandbox::NOBODY),
        }),
        username: String::new(),
        spec: Some(ImageSpec {
            image: image.id.clone(),
            ..Default::default()
        }),
        pinned: false,
    }
}
